"""Child process for ``tests/shell/test_trio_zmq.py``: a monitored PULL socket whose monitor is not
read while hundreds of peers connect and disconnect at once (several events each, more than
libzmq's default 1,000-message pipe holds). Then, on the same context, another socket pair
must still deliver (libzmq's I/O thread is not stuck in a blocking monitor send), and leaving
the monitor block must return (stopping the monitor sends one more event).

Prints one JSON line: the peers and the two checks' results. A
stall shows as the parent's timeout, since a blocked libzmq call cannot be cancelled.
"""

from __future__ import annotations

import json
import sys

import trio
import zmq

from trio_dpcoord.trio_zmq import open_context, open_monitor, open_socket


async def main(directory: str, peers: int) -> None:
    async with open_context() as context:
        context.set(zmq.MAX_SOCKETS, peers + 64)
        report: dict[str, object] = {"peers": peers}
        async with open_socket(context, zmq.PULL) as pull:
            async with open_monitor(context, pull, zmq.EVENT_ALL):
                pull.bind(f"ipc://{directory}/flood")
                pushes = []
                for _ in range(peers):
                    push = context.socket(zmq.PUSH)
                    push.setsockopt(zmq.LINGER, 0)
                    push.connect(f"ipc://{directory}/flood")
                    pushes.append(push)
                for push in pushes:  # a message each: every connection is established
                    push.send(b"x")
                with trio.fail_after(60):
                    for _ in range(peers):
                        await pull.recv_multipart()
                for push in pushes:
                    push.close()
                # Give libzmq's I/O thread time to process the disconnects (there is nothing
                # to wait on: the only signal of them is the monitor we must not read). Under
                # a heavy load this can pass without the bug showing, never fail without it.
                await trio.sleep(1)
                # Another pair on the same context (the same I/O thread) still delivers.
                other = f"ipc://{directory}/other"
                async with open_socket(context, zmq.PULL, bind=other) as a:
                    async with open_socket(context, zmq.PUSH, connect=other) as b:
                        await b.send_multipart([b"still moving"])
                        with trio.move_on_after(20) as scope:
                            report["other_socket"] = (await a.recv_multipart())[0].decode()
                        if scope.cancelled_caught:
                            report["other_socket"] = "stalled"
                # Leave the block with every event still unread: stopping must return.
            report["monitor_stopped"] = True
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]))
