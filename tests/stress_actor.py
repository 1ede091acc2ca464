"""Processes for the owner-churn stress test (``tests/test_stress.py``).

``owner``: a ``kvpool.connect`` client whose puts land in a small ``cxl``
arena (dram capacity 0). It seeds the key set, prints ``READY``, waits for the
go file, then for ``--seconds`` keeps freeing and reusing its arena extents:
delete a key, put another key *of the same size* (so it tends to take the
freed extent), overwrite keys with new versions; the arena is small, so puts
also demote the coldest objects to nvme (and the bottom tier drops them).

``reader``: a client with no cxl arena of its own that only gets those keys
(whole, layer ranges, ``out=``, ``get_many``) — locally they always miss, so
every hit comes from the owner's arena through the same-host index, a
remembered location, or the master — and checks every value received.

Both print one ``RESULT {json}`` line (see :mod:`bench.soak`: content is
derived from (key, version), so any value received can be checked).
"""

from __future__ import annotations

import argparse
import sys

from bench.soak import Worker, add_worker_args, drive_worker, shape_of, worker_config


class Owner(Worker):
    """Worker whose steps free extents and immediately reuse them with other keys of the same size."""

    def step(self) -> None:
        args = self.args
        self.counts["ops"] += 1
        i = self.key_index()
        # another key of the same shape (keys i and i + k*shapes share one)
        same = [j for j in range(args.first, args.first + args.keys)
                if j != i and shape_of(j, args.shapes) == shape_of(i, args.shapes)]
        try:
            choice = self.rng.random()
            if choice < 0.5 and same:
                self.delete(i)
                self.put(self.rng.choice(same))  # likely lands in i's freed extent
                self.put(i)
            elif choice < 0.8:
                self.put(i)  # overwrite: a new version in a new extent, the old one freed
            elif choice < 0.9:
                self.delete(i)
            else:
                self.get(i)
        except Exception as exc:  # counted, like Worker.step
            self.errors[f"owner:{type(exc).__name__}"] += 1
            if len(self.error_samples) < 5:
                self.error_samples.append(f"owner step: {type(exc).__name__}: {exc}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("owner", "reader"))
    add_worker_args(parser)
    args = parser.parse_args()
    import kvpool

    pool = kvpool.connect(args.master, config=worker_config(args), transport=args.transport)
    try:
        worker = (Owner if args.role == "owner" else Worker)(pool, args)
        if args.role == "owner":
            for i in range(args.first, args.first + args.keys):
                worker.put(i, 0)
        return drive_worker(pool, worker, args)
    finally:
        pool.close()


if __name__ == "__main__":
    sys.exit(main())

