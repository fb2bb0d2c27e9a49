"""Writer process for the SIGKILL crash test (not a test module).

Usage: crash_writer.py DB ACK_FILE TAG. Opens the store, prints "ready", then four threads record
interactions and feedback as fast as they can; after each record_feedback call returns, the
request id is appended to ACK_FILE in one write(2), so the file lists only acknowledged feedback.
"""

from __future__ import annotations

import os
import sys
import threading

from edge_runtime.feedback import Choice, FeedbackStore, Rating


def main() -> None:
    db, ack_path, tag = sys.argv[1:4]
    store = FeedbackStore(db)
    store.set_consent("crash-user", True)
    ack_fd = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    print("ready", flush=True)

    def burst(worker: int) -> None:
        i = 0
        while True:
            rid = f"{tag}-{worker}-{i}"
            store.record_interaction("crash-user", rid, f"prompt {rid}", [f"yes {rid}", f"no {rid}"],
                                     model="crash-model", timings={"total_s": 0.01})
            feedback = Choice(i % 2) if i % 3 else Rating(0, 1 + i % 5)
            store.record_feedback("crash-user", rid, feedback)
            os.write(ack_fd, f"{rid}\n".encode())
            i += 1

    threads = [threading.Thread(target=burst, args=(w,), daemon=True) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
