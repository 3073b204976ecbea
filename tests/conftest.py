"""Shared test settings: no stray SB3 log directories, and a single torch thread (2 shared cores)."""

import os

import torch as th

os.environ.setdefault("SB3_LOGDIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "sb3_kl_test_logs"))
th.set_num_threads(1)
