"""Non-blocking sends on asyncio ZeroMQ sockets, from code that cannot await."""

import zmq
import zmq.asyncio


def send_now(sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
    """Send ``frames`` at once or raise the send's ``zmq.ZMQError`` (EAGAIN, EHOSTUNREACH).

    The send goes through the asyncio socket itself, never a synchronous shadow of it:
    ZeroMQ signals readiness edge-triggered, and a send on a shadow can consume the edge
    that a pending asyncio ``recv`` waits for, leaving that receive asleep with a message
    queued. pyzmq's own non-blocking send re-checks the socket's events for its receivers.
    """
    future = sock.send_multipart(frames, zmq.NOBLOCK)
    # A NOBLOCK send with no other send pending completes (or fails) before returning.
    # pyzmq types the send as an Awaitable; zmq.asyncio's is an asyncio Future.
    error = future.exception()  # type: ignore[attr-defined]
    if error is not None:
        raise error
