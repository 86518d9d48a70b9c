"""A server launched from a torchrun rank gets none of torchrun's worker variables (with them, SGLang's own
torch.distributed init joins the trainer's store and hangs at "Init parallel begin")."""

import json
import os
import subprocess
import sys

from megatron_dapo.rollout.sglang.server import server_env

DUMP = "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))"


def test_server_env_drops_everything_torchrun_adds(tmp_path):
    script, out = tmp_path / "dump.py", tmp_path / "env.json"
    script.write_text(DUMP)
    parent = dict(os.environ) | {"OMP_NUM_THREADS": "1"}  # torchrun sets it only when it is unset
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master-port", "0",
                    str(script), str(out)], env=parent, check=True, timeout=120, capture_output=True)
    worker = json.loads(out.read_text())
    added = {k for k in worker if k not in parent or worker[k] != parent[k]}
    assert {"RANK", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"} <= added  # what made servers hang
    env = server_env(worker, {"CUDA_VISIBLE_DEVICES": "4,5"})
    assert not added & set(env), f"torchrun variables left in the server's environment: {sorted(added & set(env))}"
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert all(env[k] == parent[k] for k in parent)  # everything the user set is passed on
