"""Everything that crosses a wire, and nothing else.

* ``envelope``: the msgpack envelope, ``PROTOCOL_VERSION`` and ``ProtocolError``;
* ``step``: the step plan (scheduler -> executors) and step result (rank 0 -> scheduler);
* ``step_codec``: their validating wire format, over the type checks of ``checks``;
* ``control``: the executor control frames (handshake, heartbeats, step failures);
* ``client``: the messages between clients (SDK, CLI) and the scheduler process.
"""
