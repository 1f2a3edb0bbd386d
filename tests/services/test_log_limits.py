"""Lines any outsider can cause at will are written at most once a second, in the process's
own format: a real gateway process fed malformed HTTP requests."""

import logging
import os
import socket
import subprocess
import sys
import time

from weir.services.launcher import free_port
from weir.shared.log_limit import OncePerInterval


def test_each_kind_of_line_at_most_once_an_interval_then_the_count_held_back(caplog):
    logger = logging.getLogger("weir.test.limited")
    logger.addFilter(OncePerInterval(interval=0.2))
    with caplog.at_level(logging.WARNING, logger="weir.test.limited"):
        for i in range(50):
            logger.warning("bad frame %d", i)
            logger.warning("another kind of line")
        time.sleep(0.25)
        logger.warning("bad frame %d", 99)
    assert [r.getMessage() for r in caplog.records] == [
        "bad frame 0",
        "another kind of line",
        "bad frame 99 (49 more such line(s) held back)",
    ]


def test_what_it_remembers_is_bounded_when_lines_are_preformatted():
    limit = OncePerInterval()
    for i in range(5000):
        record = logging.LogRecord("lib", logging.WARNING, __file__, 1, f"line {i}", None, None)
        assert limit.filter(record)
    assert len(limit._last) <= 1024


def test_a_flood_of_malformed_http_requests_is_a_line_a_second(tmp_path):
    port = free_port()
    log = (tmp_path / "gateway.log").open("w+")
    gateway = subprocess.Popen(
        [sys.executable, "-m", "weir.services.cli", "gateway", "--port", str(port)]
        + ["--scheduler", f"tcp://127.0.0.1:{free_port()}"],
        stderr=log,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and gateway.poll() is None
                time.sleep(0.1)
        for _ in range(100):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(b"\x16\x03\x01 not http\r\n\r\n")
                sock.recv(1024)
    finally:
        gateway.terminate()
        gateway.wait(30)
    log.seek(0)
    lines = [line for line in log.read().splitlines() if "Invalid HTTP request" in line]
    assert 1 <= len(lines) <= 5, lines
    assert all("[gateway] WARNING uvicorn.error: Invalid HTTP request" in line for line in lines)
