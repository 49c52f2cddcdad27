"""RemoteParameters' own bookkeeping, in one process: a stand-in client answers instead of the servers."""
import threading

import torch
from torch import nn

import torchpar.ps as ps


class ImmediateClient:
    """Tables are indices; pulls and push_pulls answer at once with the tables' first values."""

    def __init__(self):
        self._values = []

    def dense_table(self, name, value, optimizer):
        self._values.append(value.clone())
        return len(self._values) - 1

    def pull(self, tables):
        future = torch.futures.Future()
        future.set_result([self._values[t] for t in tables])
        return future

    def push_pull(self, tables, grads):
        return self.pull(tables)


class FirstHolderWaits:
    """A lock whose first user announces itself, then waits for `other_done` before taking the lock:
    this forces a second thread's whole hook in between the first's arrival and its critical section."""

    def __init__(self):
        self._lock = threading.Lock()
        self._first = True
        self.first_arrived = threading.Event()
        self.other_done = threading.Event()

    def __enter__(self):
        if self._first:
            self._first = False
            self.first_arrived.set()
            self.other_done.wait(timeout=10)
        self._lock.acquire()

    def __exit__(self, *exception):
        self._lock.release()


def test_a_second_gradient_racing_the_first_is_refused():
    module = nn.Linear(2, 1, bias=False)
    remote = ps.RemoteParameters(module, ImmediateClient(), optimizer=None)
    remote._lock = FirstHolderWaits()
    gradient_ready = remote._hook(0)
    errors = []

    def deliver():
        try:
            gradient_ready(module.weight)
        except RuntimeError as error:
            errors.append(str(error))

    first = threading.Thread(target=deliver)
    first.start()
    assert remote._lock.first_arrived.wait(timeout=10)
    deliver()
    remote._lock.other_done.set()
    first.join(timeout=10)
    assert not first.is_alive()
    assert len(errors) == 1, errors
    assert "parameter 'weight' got a second gradient before step()" in errors[0]
