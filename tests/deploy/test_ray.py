"""The fleet on a local Ray instance (CPU): two replicas of the default model as a Ray Serve
deployment and the router as another; requests through the `openai` client reach both
replicas, and scaling to one replica takes the other out of the router's fleet."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install "
                                        "'skyline[fleet]')")

import openai  # noqa: E402

from skyline.deploy.ray import RayFleet  # noqa: E402
from skyline.router.launch import free_port  # noqa: E402

ARGV = ["--kv-cache-memory", "64MiB", "--max-num-seqs", "4", "--device", "cpu",
        "--threads", "1"]


def healthy_replicas(url: str) -> list[str]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return re.findall(r'skyline_router:replica_healthy\{replica="([^"]+)"\} 1\.0', text)


@pytest.mark.slow
def test_two_replicas_on_ray_serve():
    import ray

    fleet = RayFleet.deploy(
        ARGV, num_replicas=2, port=free_port(), num_cpus=0.5, timeout=600,
        ray_init={"num_cpus": 2, "object_store_memory": 80 << 20, "include_dashboard": False,
                  "log_to_driver": False})
    try:
        assert len(healthy_replicas(fleet.url)) == 2
        client = openai.OpenAI(base_url=f"{fleet.url}/v1", api_key="none", max_retries=0,
                               timeout=120)
        model = client.models.list().data[0].id
        served = set()
        for i in range(4):
            raw = client.chat.completions.with_raw_response.create(
                model=model, temperature=0, max_tokens=4,
                messages=[{"role": "user", "content": f"Say {i}"}])
            served.add(raw.headers["x-skyline-replica"])
            assert raw.parse().choices[0].message.content
        assert len(served) == 2  # new prefixes spread over both
        fleet.scale(1)
        deadline = time.monotonic() + 120
        while len(healthy_replicas(fleet.url)) != 1:
            assert time.monotonic() < deadline, "the router still routes to the removed replica"
            time.sleep(0.5)
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt="One, two,", max_tokens=4, temperature=0, stream=True)
            if c.choices)
        assert text
    finally:
        fleet.shutdown()
        ray.shutdown()
