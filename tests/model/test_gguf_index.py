"""`GGUFIndex` against gguf's own `GGUFReader`: the same tensors (names, types, shapes and
bytes), the scalar metadata, a custom alignment, and clear errors for files it cannot read."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tandem.models.gguf_index import GGUFIndex
from tandem.testing.tiny_gguf import write_tiny_gguf


def _assert_same_tensors(path: Path) -> GGUFIndex:
    reader, index = gguf.GGUFReader(str(path)), GGUFIndex(path)
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for theirs, ours in zip(reader.tensors, index.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert ours.shape == tuple(int(d) for d in theirs.shape), ours.name
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data), ours.name
    field = reader.get_field("general.architecture")
    assert index.architecture() == bytes(field.parts[field.data[0]]).decode()
    return index


def test_tiny_gguf_with_kept_and_k_quant_types(tmp_path: Path) -> None:
    types = {"token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_0"}
    types |= {"attn_v": "Q4_1", "ffn_down": "Q6_K"}
    index = _assert_same_tensors(write_tiny_gguf(tmp_path / "tiny.gguf", types))
    assert index.fields["llama.block_count"] >= 1
    assert index.fields["general.name"] == "tiny-llama"
    assert "tokenizer.ggml.tokens" not in index.fields  # arrays are stepped over, not kept


def test_custom_alignment_and_plain_types(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_custom_alignment(128)
    writer.add_array("demo.strings", ["a", "bc", "", "déf"])
    writer.add_array("demo.numbers", [1, 2, 3])
    writer.add_float32("demo.float", 0.5)
    writer.add_tensor("a.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.add_tensor("b.weight", np.arange(40, dtype=np.float16).reshape(5, 8))
    writer.add_tensor("c.weight", np.arange(7, dtype=np.int32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    index = _assert_same_tensors(path)
    assert index.fields["general.alignment"] == 128 and index.fields["demo.float"] == 0.5
    assert index.tensors[1].data.tolist() == np.arange(40, dtype=np.float16).reshape(5, 8).tolist()


def test_embedded_smollm2_gguf() -> None:
    from tandem.models.gguf_weights import gguf_source
    from tandem.models.model_files import resolve_model_dir

    path = gguf_source(resolve_model_dir("default"))
    assert path is not None
    index = _assert_same_tensors(path)
    assert index.fields["llama.vocab_size"] == 49152


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"this is not a GGUF file" * 4, "not a GGUF file"),
        (b"GGUF" + (7).to_bytes(4, "little") + b"\0" * 16, "GGUF version 7"),
    ],
)
def test_unreadable_files_raise_value_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        GGUFIndex(path)


def test_truncated_file_raises(tmp_path: Path) -> None:
    whole = write_tiny_gguf(tmp_path / "tiny.gguf", {"token_embd": "Q8_0"}).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError):
        GGUFIndex(path)


def _mapped_rss_kb(path: Path) -> int:
    """Resident kB of this process's mappings of `path` (`/proc/self/smaps`)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            inside = len(head) >= 6 and head[-1] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_dropping_pages_after_each_read_keeps_the_mapping_small_and_the_data_readable() -> None:
    """The embedded GGUF read tensor by tensor, as the loader reads it, with
    `drop_resident_pages` after each copy: the mapping's resident pages never exceed the
    largest tensor plus 4 MB, and nothing stays resident after the last drop (the kernel's
    fault-around maps neighbours of every page read: dropping only the copied tensor's
    range left about 10 MB behind). The data reads the same after."""
    from tandem.models.model_files import embedded_gguf_path

    path = embedded_gguf_path().resolve()
    index = GGUFIndex(path)
    largest = max(t.data.nbytes for t in index.tensors) // 1024
    sums, most = [], 0
    for tensor in index.tensors:
        sums.append(int(tensor.data.view(np.uint8).sum(dtype=np.uint64)))
        most = max(most, _mapped_rss_kb(path))
        index.drop_resident_pages()
    assert most < largest + 4096
    assert _mapped_rss_kb(path) < 256
    assert [int(t.data.view(np.uint8).sum(dtype=np.uint64)) for t in index.tensors] == sums
    assert _mapped_rss_kb(path) > path.stat().st_size // 1024 // 2  # read back: resident


def test_the_type_table_is_ggufs() -> None:
    """`GGMLQuantizationType` and `GGML_QUANT_SIZES` (defined here so loading imports no
    gguf) hold gguf's own names, ids and block sizes."""
    from tandem.models.gguf_index import GGML_QUANT_SIZES, GGMLQuantizationType

    theirs = {t.name: int(t) for t in gguf.GGMLQuantizationType}
    assert {t.name: int(t) for t in GGMLQuantizationType} == theirs
    assert {t.name: size for t, size in GGML_QUANT_SIZES.items()} == {
        t.name: gguf.GGML_QUANT_SIZES[t] for t in gguf.GGMLQuantizationType
    }


def test_an_unknown_tensor_type_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", {"token_embd": "Q8_0"})
    index = GGUFIndex(path)
    first = index.tensors[0]
    data = bytearray(path.read_bytes())
    # the first tensor's info: name (u64 length + bytes), n_dims (u32), dims (u64 each), type
    at = data.index(first.name.encode()) + len(first.name) + 4 + 8 * len(first.shape)
    assert int.from_bytes(data[at : at + 4], "little") == int(first.tensor_type)
    data[at : at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{first.name}.*unknown GGML type id 99"):
        GGUFIndex(bad)
