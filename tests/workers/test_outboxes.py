"""The supervisor's readers of worker pipes, on real pipes: a remote worker's own reader
(`sibling`) delivers what its worker sends and ends once that worker's pipe has, where
the main reader keeps reading for workers still to come."""

from __future__ import annotations

from multiprocessing import Pipe

from server_process import wait_until

from appliance.workers.messages import FromWorker, Ready
from appliance.workers.outboxes import Outbox, OutboxReader


def test_a_remote_workers_reader_ends_with_its_pipe() -> None:
    got: list[FromWorker] = []
    main = OutboxReader(got.append)
    main.start()
    reader = main.sibling()
    theirs, ours = Pipe()
    reader.add(7, theirs)
    reader.start()
    Outbox(ours).put(Ready(7, 10))
    wait_until(lambda: got, 10, "the message", every_s=0.01)  # threads here: look often
    assert got == [Ready(7, 10)] and reader.running
    ours.close()  # the worker is gone
    wait_until(lambda: not reader.running, 10, "the reader to end", every_s=0.01)
    assert main.running  # the main reader waits for workers still to come
    main.stop()
