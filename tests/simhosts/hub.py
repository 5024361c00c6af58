#!/usr/bin/env python3
"""The wire between simulated hosts (scripts/sim-hosts): a learning Ethernet switch in one
process. This kernel has no veth, so each host's link is a tap device `eth0` created inside that
host's network namespace, whose frames this process carries to the others' taps. The taps live
as long as this process holds them: when it exits, they go with it.

Usage: hub.py READY_FILE NETNS_FILE...  (each NETNS_FILE a /proc/<pid>/ns/net of a host)"""

import ctypes
import fcntl
import os
import select
import signal
import struct
import sys

CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
# Frames as large as a tap carries: the harness sets a large MTU so that a TCP stream is few
# frames, which this loop can move at hundreds of MB/s.
FRAME = 65536 + 64

libc = ctypes.CDLL(None, use_errno=True)


def setns(fd):
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def tap_in(netns):
    """A tap named eth0 in the network namespace `netns` (a path), open in this process."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    there = os.open(netns, os.O_RDONLY)
    try:
        setns(there)
        # The device is made in the namespace of the process that asks for it.
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", b"eth0", IFF_TAP | IFF_NO_PI))
        os.set_blocking(fd, False)
        return fd
    finally:
        setns(home)
        os.close(there)
        os.close(home)


def main():
    ready, spaces = sys.argv[1], sys.argv[2:]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ports = [tap_in(s) for s in spaces]
    with open(ready, "w") as f:
        f.write("%d\n" % os.getpid())
    where = {}  # MAC -> port it was last seen on
    poll = select.poll()
    for fd in ports:
        poll.register(fd, select.POLLIN)
    while True:
        for fd, _ in poll.poll():
            # Drain this port: a burst of frames costs one poll.
            for _ in range(64):
                try:
                    frame = os.read(fd, FRAME)
                except (BlockingIOError, OSError):
                    break
                if len(frame) < 14:
                    continue
                where[frame[6:12]] = fd
                out = where.get(frame[0:6])
                targets = [out] if out is not None and not frame[0] & 1 else ports
                for t in targets:
                    if t == fd:
                        continue
                    try:
                        os.write(t, frame)
                    except OSError:
                        # A link that is down, or a full queue: the frame is lost, as on a wire.
                        pass


if __name__ == "__main__":
    main()
