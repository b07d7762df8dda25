"""A Ray cluster with token authentication on (RAY_AUTH_MODE=token, set by the test): a DDP call
across it works, and a driver holding the wrong token is refused by Ray. Prints what it saw."""

import os
import subprocess
import sys

import ray
import torch
from ray.cluster_utils import Cluster

import mpify_nb

cluster = Cluster(initialize_head=True,
                  head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.5", "include_dashboard": False})
cluster.add_node(num_cpus=1, node_ip_address="127.0.0.6")
try:
    mpify_nb.set_placement("ray", address=cluster.address)

    def reduce_ones():
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    print("values", mpify_nb.ranch(2, reduce_ones, ctx=mpify_nb.in_torchddp()), flush=True)
    intruder = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address={cluster.address!r}); print('CONNECTED')"],
        env=dict(os.environ, RAY_AUTH_TOKEN="0" * 32), capture_output=True, text=True, timeout=120)
    print("intruder connected" if "CONNECTED" in intruder.stdout else "intruder refused", flush=True)
finally:
    mpify_nb.set_placement("local")
    ray.shutdown()
    cluster.shutdown()
