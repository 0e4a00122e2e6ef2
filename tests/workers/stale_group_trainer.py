"""A trainer that forms the weight-update group with one server, opens a weight-update session, announces an
update, then waits to be killed before broadcasting anything (the server is left receiving from a dead peer,
its session open).

usage: stale_group_trainer.py URL API_KEY MASTER_PORT GROUP_NAME TENSOR_NAME SHAPE_JSON
"""

import json
import os
import sys
import threading
import time

import httpx


def main():
    url, key, port, group, name, shape = sys.argv[1:]
    from megatron_dapo.rollout import payloads
    from megatron_dapo.rollout import weight_group as wgroup
    from megatron_dapo.runtime.net import LOOPBACK

    def post(path, body):
        return httpx.post(
            url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=600, trust_env=False
        )

    init = threading.Thread(
        target=post,
        args=("/init_weights_update_group", payloads.init_group_body(LOOPBACK, int(port), 1, 2, group, "gloo")),
    )
    init.start()
    wgroup.init_weight_update_group(LOOPBACK, int(port), 0, 2, group, "gloo", timeout_s=60)
    init.join()
    assert post("/begin_weight_update", payloads.begin_update_body()).json()["success"]
    body = payloads.update_distributed_body([name], ["float32"], [json.loads(shape)], group)
    threading.Thread(target=post, args=("/update_weights_from_distributed", body), daemon=True).start()
    print("announced", os.getpid(), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
