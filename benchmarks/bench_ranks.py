"""What every benchmark needs to start its ranks on this host."""
import socket


def free_port() -> int:
    """A loopback port nobody listens on now, for the ranks' rendezvous store."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
