"""`serve.peer_rows` between two real processes (jax.distributed on 127.0.0.1, NIXL over UCX): what process 0
collects is bitwise what the peer offered; a peer that cannot offer (its pool too small) and a peer that never posts
are RuntimeErrors naming the process and the cause, within the timeout (the endpoint then answers after the export);
records handed on (a composed answer's parts) name the peer's pieces; offers process 0 drops, discards or pulls leave
the peer's pool empty."""

import json
import os
import subprocess
import sys

import pytest

from support import REPO, free_port, launcher_env

pytest.importorskip("nixl")


def test_peer_rows_collect_offer_failures_and_discard(tmp_path):
    port = free_port()
    script = os.path.join(REPO, "tests", "peer_rows_driver.py")
    procs = [subprocess.Popen([sys.executable, script, str(i), str(port)], cwd=REPO, env=launcher_env(),
                              stdout=subprocess.PIPE, stderr=open(tmp_path / f"p{i}.log", "w"), text=True)
             for i in (1, 0)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [(tmp_path / f"p{i}.log").read_text()[-2000:] for i in (1, 0)]
    lines = {d["case"]: d for d in (json.loads(x) for x in "".join(outs).splitlines() if x.startswith('{"case"'))}
    assert lines["ok"]["same"] is True
    assert "process 1 could not offer its rows of too-big: KVPoolFull" in lines["too-big"]["error"]
    assert "process 1 posted no rows of never within 2 s" in lines["never"]["error"]
    assert lines["empty"]["got"] == []
    assert lines["records"] == {"case": "records", "count": 1, "pieces": [[1, 0, 4], [0, 4, 13]]}
    assert "process 1 could not offer its rows of rec-too-big: KVPoolFull" in lines["records-too-big"]["error"]
    assert lines["pool"]["entries"] == 0 and lines["pool"]["used_bytes"] == 0, lines["pool"]
    # process 0 sees process 1's pool as process 1 last posted it (GET /v1/kv/pool's "peers")
    peer = lines["peer-pools"]["pools"]["1"]
    assert set(lines["peer-pools"]["pools"]) == {"1"} and peer["capacity_bytes"] == 1 << 20, peer
    assert peer["pool"].startswith("slope-kvpool-") and 0 <= peer["age_s"] < 5 and peer["entries"] >= 0, peer


# the all-gather fallback (no NIXL) under -m slow: 26 s of a cold suite for the path a deployment without NIXL takes
# both under -m slow (83 s and 26 s of a cold suite): the default suite keeps the NIXL offer path end to end in
# test_pd_vllm (a 2-process endpoint answering every request from offered rows) and test_nixl_transport
@pytest.mark.parametrize("mode", [pytest.param("nixl", marks=pytest.mark.slow),
                                  pytest.param("gather", marks=pytest.mark.slow)])
def test_engine_rows_for_under_two_processes_equal_the_export(tmp_path, mode):
    """`PrefillEngine.prefill(rows_for=...)` under two processes (ring 2: each holds half of every layer's rows, in
    zigzag order): the rows process 0's `on_computed` gets are bitwise the export written after, for a cold prompt
    and a prefix hit (its cached rows joined), sliding layers cut to their kept range — with the other process
    offering its pieces over NIXL (`peer_rows`) and with the all-gather fallback; a prompt whose rows were not
    asked for leaves nothing in the peer's pool."""
    port = free_port()
    script = os.path.join(REPO, "tests", "rows_for_driver.py")
    procs = [subprocess.Popen([sys.executable, script, str(i), str(port), str(tmp_path / "kv"), mode], cwd=REPO,
                              env=launcher_env(), stdout=subprocess.PIPE, stderr=open(tmp_path / f"p{i}.log", "w"),
                              text=True) for i in (1, 0)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [(tmp_path / f"p{i}.log").read_text()[-2000:] for i in (1, 0)]
    lines = [json.loads(x) for x in "".join(outs).splitlines() if x.startswith("{")]
    rows = {d["id"]: d for d in lines if "id" in d}
    assert rows == {"cold": {"id": "cold", "same": True, "cached": 0},
                    "hit": {"id": "hit", "same": True, "cached": 64}}, lines
    pools = [d["pool"] for d in lines if "pool" in d]
    assert pools == ([] if mode == "gather" else [pools[0]]) and all(p["entries"] == 0 for p in pools), pools
