"""A spawned child that tells its parent which GPUs it was started with (imports nothing heavy, so a
test can start many)."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection


def report_visible_devices(conn: Connection) -> None:
    conn.send(os.environ.get("CUDA_VISIBLE_DEVICES"))
    conn.close()
