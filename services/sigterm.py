"""SIGTERM as an exception, for a process that stops gracefully on it: `weir serve` (which
then drains) and the gateway (which then exits 0)."""


class Terminated(Exception):
    """SIGTERM reached the process while ``raise_terminated`` was its handler."""


def raise_terminated(signum: int, frame: object) -> None:
    raise Terminated
