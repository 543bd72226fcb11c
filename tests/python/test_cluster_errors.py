"""Issue 29 §3: the Python side tells the cluster's faults from the caller's, with real
processes (a real ``kvtier master`` and ``kvtier serve --master`` node from test_cluster).

* A store that cannot reach any master raises ``kvtier.UnavailableError`` (a RuntimeError),
  not a bare RuntimeError; a bad setting is still a ValueError.
* A put no node has room for (the client requires a tag no node carries) fails with a per-key
  error that says "no room" and names the key once, never "malformed batch"; after the node
  is SIGKILLed, a read of its object says "node unavailable".
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvtier
from test_cluster import TOKEN, cluster, free_port, kvtier_bin  # noqa: F401 (fixtures)


def test_no_master_raises_unavailable(monkeypatch):
    monkeypatch.setenv("KVTIER_CLUSTER_TOKEN", TOKEN)
    config = dict(
        master_address=f"127.0.0.1:{free_port()}",
        cluster_request_timeout_ms=300,
        cluster_master_retry_ms=300,
    )
    with pytest.raises(kvtier.UnavailableError) as info:
        kvtier.Store(json.dumps(config))
    assert isinstance(info.value, RuntimeError)
    assert "malformed" not in str(info.value)
    assert issubclass(kvtier.BusyError, RuntimeError)
    # The caller's mistake stays a ValueError.
    with pytest.raises(ValueError):
        kvtier.Store(json.dumps(dict(config, cluster_request_timeout_ms="soon")))


def test_no_room_and_node_down_are_named_for_what_they_are(cluster):
    c = cluster()
    c.add_node("node-a", "127.0.0.2")
    c.master.wait_nodes(["node-a"])
    config = c.store_config("node-a")
    del config["node_id"]  # not co-located: reads go over the data port
    tagged = kvtier.Store(json.dumps(dict(config, node_tags="no-such-tag")))
    value = np.arange(4096, dtype=np.uint8)
    ok, errors = tagged.put_buffers(["needs-a-tag"], [value])
    assert ok == [False], errors
    assert len(errors) == 1 and "no room" in errors[0], errors
    assert errors[0].count("needs-a-tag") == 1, errors
    assert "malformed" not in errors[0], errors

    plain = kvtier.Store(json.dumps(config))
    ok, errors = plain.put_buffers(["on-a"], [value])
    assert ok == [True], errors
    c.nodes["node-a"].sigkill()
    dst = np.zeros(4096, dtype=np.uint8)
    ok, errors = plain.get_buffers(["on-a"], [dst])
    assert ok == [False]
    assert len(errors) == 1 and "node unavailable" in errors[0], errors
    assert "malformed" not in errors[0], errors
