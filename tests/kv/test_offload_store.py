"""The offload KV store's three parts, without an engine.

- `keys`: block keys are deterministic, chained over the whole prefix, extendable in place
  and file-name safe; `engine_signature` follows the block size and the model's files.
- `index.OffloadIndex`: the LRU tiers and the exact moves (demote, drop_cpu, drop_disk) a
  plan carries, recency refreshes, `forget`, and the adoption of an existing directory.
- `store.OffloadStore`: bit-exact round trips through the cpu and disk tiers, and every bad
  stored block (missing, truncated, corrupt, foreign, of another layout) is a recorded
  failed load that removes the file instead of raising.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.plugins.kv_offload.index import FILE_SUFFIX, OffloadIndex, OffloadPlan
from tandem.plugins.kv_offload.keys import engine_signature, extend_keys
from tandem.plugins.kv_offload.store import OffloadStore
from tandem.schema.config import EngineConfig

SIG = "0123456789abcdef"
BS = 4


def keys_of(tokens: list[int], num_blocks: int, signature: str = SIG) -> list[str]:
    return extend_keys([], signature, tokens, BS, num_blocks)


# keys -----------------------------------------------------------------------------------


def test_keys_are_deterministic_and_hex() -> None:
    tokens = list(range(20))
    a, b = keys_of(tokens, 5), keys_of(list(tokens), 5)
    assert a == b
    assert len(a) == 5 and len(set(a)) == 5
    assert all(re.fullmatch(r"[0-9a-f]{64}", k) for k in a)


def test_keys_depend_on_the_signature() -> None:
    tokens = list(range(8))
    assert keys_of(tokens, 2, SIG) != keys_of(tokens, 2, "fedcba9876543210")
    assert keys_of(tokens, 2, SIG)[1] != keys_of(tokens, 2, "fedcba9876543210")[1]


def test_keys_are_chained_over_the_prefix() -> None:
    tokens = list(range(100, 120))
    base = keys_of(tokens, 5)
    first = list(tokens)
    first[0] = 999  # block 0 changes: every key changes
    changed = keys_of(first, 5)
    assert all(x != y for x, y in zip(base, changed, strict=True))
    third = list(tokens)
    third[2 * BS + 1] = 999  # block 2 changes: keys 0-1 stay, 2-4 change
    changed = keys_of(third, 5)
    assert changed[:2] == base[:2]
    assert all(x != y for x, y in zip(base[2:], changed[2:], strict=True))


def test_extend_keys_extends_in_place_like_from_scratch() -> None:
    tokens = list(range(7, 31))
    keys: list[str] = []
    out = extend_keys(keys, SIG, tokens, BS, 2)
    assert out is keys and len(keys) == 2
    extend_keys(keys, SIG, tokens, BS, 6)
    assert keys == keys_of(tokens, 6)
    extend_keys(keys, SIG, tokens, BS, 3)  # fewer than held: nothing changes
    assert keys == keys_of(tokens, 6)


def _config(model_dir: Path, block_size: int = 16) -> EngineConfig:
    return EngineConfig(model={"model": str(model_dir)}, cache={"block_size": block_size})


def test_engine_signature_follows_block_size_and_model_files(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    os.utime(weights, ns=(1_000_000_000, 1_000_000_000))
    sig = engine_signature(_config(tmp_path))
    assert re.fullmatch(r"[0-9a-f]{16}", sig)
    assert engine_signature(_config(tmp_path)) == sig
    assert engine_signature(_config(tmp_path, block_size=32)) != sig

    os.utime(weights, ns=(2_000_000_000, 2_000_000_000))  # mtime only
    touched = engine_signature(_config(tmp_path))
    assert touched != sig
    weights.write_bytes(b"x" * 11)  # size (and mtime)
    os.utime(weights, ns=(2_000_000_000, 2_000_000_000))  # same mtime as `touched`
    assert engine_signature(_config(tmp_path)) not in (sig, touched)


# index ----------------------------------------------------------------------------------


def test_index_save_enters_cpu_and_demotes_lru_to_disk(tmp_path: Path) -> None:
    index = OffloadIndex(cpu_blocks=2, disk_blocks=2, disk_dir=tmp_path)
    index.plan_save("a", 0)
    index.plan_save("b", 1)
    assert index.tier_of("a") == "cpu" and index.tier_of("b") == "cpu"
    index.plan_save("c", 2)
    plan = index.take_plan()
    assert plan.saves == [("a", 0), ("b", 1), ("c", 2)]
    assert plan.moves == [("demote", "a")]
    assert plan.loads == []
    assert list(index.cpu) == ["b", "c"] and list(index.disk) == ["a"]
    assert index.take_plan() == OffloadPlan()  # a fresh, empty plan

    index.plan_save("d", 3)  # demotes b
    index.plan_save("e", 4)  # demotes c; disk over 2: drops a
    plan = index.take_plan()
    assert plan.saves == [("d", 3), ("e", 4)]
    assert plan.moves == [("demote", "b"), ("demote", "c"), ("drop_disk", "a")]
    assert list(index.cpu) == ["d", "e"] and list(index.disk) == ["b", "c"]
    assert index.tier_of("a") is None


@pytest.mark.parametrize("disk", ["no_dir", "zero_blocks"])
def test_index_without_disk_tier_drops_from_cpu(tmp_path: Path, disk: str) -> None:
    if disk == "no_dir":
        index = OffloadIndex(cpu_blocks=1, disk_blocks=4, disk_dir=None)
    else:
        index = OffloadIndex(cpu_blocks=1, disk_blocks=0, disk_dir=tmp_path)
    index.plan_save("a", 0)
    index.plan_save("b", 1)
    plan = index.take_plan()
    assert plan.saves == [("a", 0), ("b", 1)]
    assert plan.moves == [("drop_cpu", "a")]
    assert list(index.cpu) == ["b"] and not index.disk
    assert index.tier_of("a") is None


def test_index_save_of_held_key_only_refreshes(tmp_path: Path) -> None:
    index = OffloadIndex(cpu_blocks=2, disk_blocks=2, disk_dir=tmp_path)
    index.plan_save("a", 0)
    index.plan_save("b", 1)
    index.take_plan()
    index.plan_save("a", 7)  # held: a becomes the most recent, nothing saved
    assert index.take_plan() == OffloadPlan()
    assert list(index.cpu) == ["b", "a"]
    index.plan_save("c", 2)  # so b, not a, is demoted
    assert index.take_plan().moves == [("demote", "b")]
    index.plan_save("d", 3)
    index.take_plan()  # demotes a: disk is [b, a]
    assert list(index.disk) == ["b", "a"]
    index.plan_save("b", 9)  # held on disk: refreshed there, not saved
    plan = index.take_plan()
    assert plan.saves == [] and plan.moves == []
    assert list(index.disk) == ["a", "b"]


def test_index_plan_load_records_tier_and_refreshes(tmp_path: Path) -> None:
    index = OffloadIndex(cpu_blocks=2, disk_blocks=2, disk_dir=tmp_path)
    for i, key in enumerate("abcd"):
        index.plan_save(key, i)
    index.take_plan()  # cpu [c, d], disk [a, b]
    index.plan_load("c", 10)
    index.plan_load("a", 11)
    plan = index.take_plan()
    assert plan.loads == [("c", 10, "cpu"), ("a", 11, "disk")]
    assert plan.saves == [] and plan.moves == []
    assert list(index.cpu) == ["d", "c"] and list(index.disk) == ["b", "a"]
    index.plan_save("e", 4)  # demotes d (not c); disk drops b (not a)
    assert index.take_plan().moves == [("demote", "d"), ("drop_disk", "b")]
    with pytest.raises(AssertionError):
        index.plan_load("zzz", 0)


def test_index_forget_removes_from_both_tiers(tmp_path: Path) -> None:
    index = OffloadIndex(cpu_blocks=1, disk_blocks=2, disk_dir=tmp_path)
    index.plan_save("a", 0)
    index.plan_save("b", 1)  # a on disk, b in cpu
    index.take_plan()
    index.forget("a")
    index.forget("b")
    index.forget("never-held")
    assert index.tier_of("a") is None and index.tier_of("b") is None
    assert not index.cpu and not index.disk
    index.plan_save("a", 5)  # saved anew after a forget
    assert index.take_plan().saves == [("a", 5)]


def test_index_adopts_existing_files_oldest_first(tmp_path: Path) -> None:
    for age, key in enumerate(["old", "mid", "new", "newest"]):
        path = tmp_path / (key + FILE_SUFFIX)
        path.write_bytes(b"")
        os.utime(path, ns=(age * 10**9 + 10**9, age * 10**9 + 10**9))
    (tmp_path / "ignored.tmp").write_bytes(b"")
    index = OffloadIndex(cpu_blocks=2, disk_blocks=2, disk_dir=tmp_path)
    assert list(index.disk) == ["new", "newest"] and not index.cpu
    assert index.take_plan().moves == [("drop_disk", "old"), ("drop_disk", "mid")]

    roomy = OffloadIndex(cpu_blocks=2, disk_blocks=10, disk_dir=tmp_path)
    assert list(roomy.disk) == ["old", "mid", "new", "newest"]
    assert roomy.take_plan() == OffloadPlan()
    assert roomy.tier_of("old") == "disk"


# store ----------------------------------------------------------------------------------

NUM_BLOCKS = 6


def make_pools(num_layers: int = 3, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(NUM_BLOCKS, 2, 4, 4, generator=gen),
            torch.randn(NUM_BLOCKS, 4, 2, 4, generator=gen),
        )
        for _ in range(num_layers)
    ]


def make_store(disk_dir: Path | None, num_layers: int = 3) -> OffloadStore:
    store = OffloadStore(disk_dir)
    store.kv_caches = make_pools(num_layers)
    return store


def assert_same_block(store: OffloadStore, src: int, dst: int) -> None:
    for k, v in store.kv_caches:
        assert torch.equal(k[dst], k[src])
        assert torch.equal(v[dst], v[src])


def assert_block_differs(store: OffloadStore, src: int, dst: int) -> None:
    assert any(not torch.equal(k[dst], k[src]) for k, _ in store.kv_caches)


def save_to_disk(store: OffloadStore, key: str, block_id: int) -> Path:
    store.save(OffloadPlan(saves=[(key, block_id)]))
    store.save(OffloadPlan(moves=[("demote", key)]))
    assert store.disk_dir is not None
    return store.disk_dir / (key + FILE_SUFFIX)


def load_one(store: OffloadStore, key: str, block_id: int, tier: str) -> set[int]:
    store.load(OffloadPlan(loads=[(key, block_id, tier)]))
    return store.take_failures()


def test_store_cpu_round_trip_is_bit_exact(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    assert_block_differs(store, 2, 5)
    store.save(OffloadPlan(saves=[("a", 2)]))
    assert set(store.host) == {"a"}
    # the host copy is a copy: overwriting the pool's block 2 does not change it
    original = [(k[2].clone(), v[2].clone()) for k, v in store.kv_caches]
    for k, v in store.kv_caches:
        k[2].fill_(0.0)
        v[2].fill_(0.0)
    assert load_one(store, "a", 5, "cpu") == set()
    for (k, v), (k0, v0) in zip(store.kv_caches, original, strict=True):
        assert torch.equal(k[5], k0) and torch.equal(v[5], v0)
    assert "a" in store.host  # a load keeps the copy


def test_store_demote_writes_file_and_disk_round_trip(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    path = save_to_disk(store, "a", 2)
    assert path.is_file()
    assert "a" not in store.host
    assert [p.name for p in tmp_path.iterdir()] == ["a" + FILE_SUFFIX]  # no temp left
    assert_block_differs(store, 2, 5)
    assert load_one(store, "a", 5, "disk") == set()
    assert_same_block(store, 2, 5)
    assert path.is_file()  # a good load keeps the file


def test_store_disk_block_read_by_another_store(tmp_path: Path) -> None:
    writer = make_store(tmp_path)
    save_to_disk(writer, "a", 1)
    reader = OffloadStore(tmp_path)
    reader.kv_caches = make_pools(seed=1)
    assert load_one(reader, "a", 4, "disk") == set()
    for (k, v), (wk, wv) in zip(reader.kv_caches, writer.kv_caches, strict=True):
        assert torch.equal(k[4], wk[1]) and torch.equal(v[4], wv[1])


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-5])


def _flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 7] ^= 0x01
    path.write_bytes(bytes(data))


def _wrong_magic(path: Path) -> None:
    header_line, payload = path.read_bytes().split(b"\n", 1)
    header = json.loads(header_line)
    header["magic"] = "something-else"
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)


def _rewrite_header(path: Path, payload: bytes, **changes: object) -> None:
    """A file with a consistent CRC but the header fields in `changes` (None: removed)."""
    header = json.loads(path.read_bytes().split(b"\n", 1)[0])
    header.update(changes)
    header = {k: v for k, v in header.items() if v is not None}
    header["crc32"] = zlib.crc32(payload)
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)


def _empty_payload_valid_crc(path: Path) -> None:
    _rewrite_header(path, b"", shape=[0])


def _no_shape(path: Path) -> None:
    _rewrite_header(path, b"\0" * 4, shape=None)


def _text_shape(path: Path) -> None:
    _rewrite_header(path, b"\0" * 4, shape=["x"])


def _truncate_into_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:10])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _other_layout(path: Path) -> None:
    other = make_store(path.parent, num_layers=2)
    save_to_disk(other, path.name[: -len(FILE_SUFFIX)], 2)


@pytest.mark.parametrize(
    "damage",
    [
        _truncate,
        _flip_payload_byte,
        _wrong_magic,
        _truncate_into_header,
        _empty,
        _other_layout,
        _empty_payload_valid_crc,
        _no_shape,
        _text_shape,
    ],
)
def test_store_bad_file_is_a_failed_load(tmp_path: Path, damage: Callable[[Path], None]) -> None:
    store = make_store(tmp_path)
    path = save_to_disk(store, "a", 2)
    damage(path)
    assert path.is_file()
    before = [(k[5].clone(), v[5].clone()) for k, v in store.kv_caches]
    assert load_one(store, "a", 5, "disk") == {5}
    assert not path.exists()  # the bad file is removed
    for (k, v), (k0, v0) in zip(store.kv_caches, before, strict=True):  # pool untouched
        assert torch.equal(k[5], k0) and torch.equal(v[5], v0)


def test_store_missing_file_is_a_failed_load(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    assert load_one(store, "nothing", 3, "disk") == {3}


def test_store_cpu_load_of_absent_key_is_a_failure(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    store.save(OffloadPlan(saves=[("a", 2)]))
    store.load(OffloadPlan(loads=[("missing", 4, "cpu"), ("a", 5, "cpu")]))
    assert store.take_failures() == {4}  # the good load of the same plan still applies
    assert_same_block(store, 2, 5)
    assert store.take_failures() == set()  # read once


def test_store_cpu_payload_of_other_layout_is_a_failure(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    store.host["a"] = torch.zeros(3, 2, 32, dtype=torch.float16)  # right shape, wrong dtype
    store.host["b"] = torch.zeros(2, 2, 32)  # wrong shape
    store.load(OffloadPlan(loads=[("a", 1, "cpu"), ("b", 3, "cpu")]))
    assert store.take_failures() == {1, 3}
    assert not store.host  # both removed


def test_store_drop_moves_remove_copies(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    path = save_to_disk(store, "a", 1)
    store.save(OffloadPlan(saves=[("b", 2)]))
    assert "b" in store.host and path.is_file()
    store.save(OffloadPlan(moves=[("drop_cpu", "b"), ("drop_disk", "a")]))
    assert not store.host
    assert not path.exists()
    # dropping what is not there is harmless
    store.save(OffloadPlan(moves=[("drop_cpu", "b"), ("drop_disk", "a")]))
    assert load_one(store, "b", 3, "cpu") == {3}


def test_store_applies_saves_before_moves(tmp_path: Path) -> None:
    """A plan that saves a key and demotes it (a tier of one block) writes the new copy."""
    store = make_store(tmp_path)
    store.save(OffloadPlan(saves=[("a", 2)], moves=[("demote", "a")]))
    assert "a" not in store.host
    assert (tmp_path / ("a" + FILE_SUFFIX)).is_file()
    assert load_one(store, "a", 0, "disk") == set()
    assert_same_block(store, 2, 0)


def test_index_plans_applied_by_store_stay_consistent(tmp_path: Path) -> None:
    """The index's view and the store's contents agree after a run of plans."""
    index = OffloadIndex(cpu_blocks=2, disk_blocks=2, disk_dir=tmp_path)
    store = make_store(tmp_path)
    for i, key in enumerate("abcde"):
        index.plan_save(key, i)
        plan = index.take_plan()
        store.load(plan)
        store.save(plan)
    assert set(store.host) == set(index.cpu) == {"d", "e"}
    on_disk = {p.name[: -len(FILE_SUFFIX)] for p in tmp_path.glob("*" + FILE_SUFFIX)}
    assert on_disk == set(index.disk) == {"b", "c"}
    index.plan_load("b", 5)
    plan = index.take_plan()
    store.load(plan)
    assert store.take_failures() == set()
    assert_same_block(store, 1, 5)
