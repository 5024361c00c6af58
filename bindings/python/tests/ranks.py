"""Ranks of an in-process group on threads, for the tests."""
import threading

import gradacc


def run_ranks(world, fn):
    """Runs fn(comm, rank) for every rank of a local group, one thread each; returns the results."""
    comms = gradacc.local_group(world)
    results, errors = [None] * world, []

    def body(r):
        try:
            results[r] = fn(comms[r], r)
        except BaseException as e:  # reported on the main thread below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in comms:
        c.close()
    if errors:
        raise errors[0]
    return results
