"""Where each weight-sync source hosts its update group's store (megatron_dapo.sync.addresses), and the
checks that refuse, by name, an address no server on another node could reach. One machine: the node
address comes from the rank's own setting (MEGATRON_DAPO_NODE_ADDRESS) or from the kernel's route to the
servers, checked against this machine's interfaces (psutil); other nodes are placements with another node id.
The PP=2 degrade test in test_sync_sources.py runs a source whose group forms at its own setting."""

import socket

import psutil
import pytest

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.config.validate import validate_config
from megatron_dapo.runtime.net import LOOPBACK, is_loopback
from megatron_dapo.sync.addresses import NODE_ADDRESS_ENV, store_address, unreachable_sources
from tests.runtime.test_bind_host import CONFIG

NOT_HERE = "192.0.2.250"  # TEST-NET-1: an address of no interface of this machine (checked below)


def _own_external() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not is_loopback(a.address):
                return a.address
    return None


def _own_addresses() -> set[str]:
    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}


def test_rank0_hosts_at_bind_host_and_another_source_at_its_own_setting():
    urls = [f"http://{LOOPBACK}:30000"]
    assert store_address(0, "10.9.8.7", urls, env={NODE_ADDRESS_ENV: LOOPBACK}) == "10.9.8.7"
    # no setting: the node's address on its route to the first server (loopback servers: loopback)
    assert store_address(1, "10.9.8.7", urls, env={}) == LOOPBACK
    own = _own_external()
    if own is not None:
        assert store_address(1, LOOPBACK, urls, env={NODE_ADDRESS_ENV: own}) == own
        assert store_address(1, LOOPBACK, [f"http://{own}:30000"], env={}) == own


@pytest.mark.parametrize("given", [NOT_HERE, "0.0.0.0", "node-a"])
def test_a_node_address_not_of_this_node_is_refused_naming_the_variable_and_rank(given):
    assert NOT_HERE not in _own_addresses()
    with pytest.raises(ValueError, match=rf"{NODE_ADDRESS_ENV}='{given}' on trainer rank 3 .* must be one IP"):
        store_address(3, LOOPBACK, [f"http://{LOOPBACK}:30000"], env={NODE_ADDRESS_ENV: given})


def test_sources_on_another_node_need_addresses_and_servers_off_loopback():
    remote = ["http://10.0.0.20:30000"]
    # one node: loopback everywhere is fine
    assert unreachable_sources([(0, "a", LOOPBACK), (1, "a", LOOPBACK)], [f"http://{LOOPBACK}:1"]) == []
    # rank 2 on another node, hosting at its cluster address, servers by cluster address: fine
    assert unreachable_sources([(0, "a", "10.0.0.1"), (2, "b", "10.0.0.2")], remote) == []
    errors = unreachable_sources([(0, "a", "10.0.0.1"), (2, "b", LOOPBACK)], remote)
    assert len(errors) == 1 and "source rank 2 on node b" in errors[0] and NODE_ADDRESS_ENV in errors[0]
    errors = unreachable_sources([(0, "a", "10.0.0.1"), (2, "b", "10.0.0.2")], ["http://localhost:30000"])
    assert len(errors) == 1 and "cannot reach rollout server http://localhost:30000" in errors[0]


def test_a_loopback_bind_host_with_a_server_on_another_machine_is_refused_by_name():
    assert NOT_HERE not in _own_addresses()
    with pytest.raises(ConfigError) as err:  # load_config validates
        load_config(CONFIG, [f"rollout.servers=[http://{NOT_HERE}:30000]", "trainer.launcher=torchrun"])
    want = f"trainer.bind_host=127.0.0.1 is loopback, but rollout.servers[0]=http://{NOT_HERE}:30000 is on another"
    assert want in str(err.value)
    ok = load_config(CONFIG, ["rollout.servers=[http://localhost:30000]", "trainer.launcher=torchrun"])
    validate_config(ok)
