"""Conversations in parquet files and `datasets` folders (loom/data/tables.py) read as the same JSONL does:
the same conversations, rows named file:row N, and a job on a parquet source trains as on its JSONL."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_job_overrides, user_data_overrides, write_user_data

from loom.config import ConfigError
from loom.job import load_config
from loom.data.conversations import BadSample, ConversationFile

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from loom.data.tables import TableConversations  # noqa: E402


def _records(jsonl, prefix: str = "") -> list[dict]:
    """The JSONL's objects as a table holds them: every content a list of parts (a column has one type), the
    media paths under `prefix`."""
    out = []
    for line in jsonl.read_text().splitlines():
        record = json.loads(line)
        for m in record["messages"]:
            if isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
            for part in m["content"]:
                if "path" in part:
                    part["path"] = prefix + part["path"]
        out.append(record)
    return out


def _arrow_folder(folder, records: list[dict]) -> None:
    """What `datasets.save_to_disk` writes: arrow files in the streaming format."""
    folder.mkdir()
    table = pa.Table.from_pylist(records)
    with pa.ipc.new_stream(str(folder / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table)


@pytest.fixture
def sources(tmp_path):
    jsonl = write_user_data(tmp_path / "data")
    pq.write_table(pa.Table.from_pylist(_records(jsonl)), tmp_path / "data" / "data.parquet")
    _arrow_folder(tmp_path / "data" / "saved", _records(jsonl, prefix="../"))  # paths relative to the folder
    return jsonl, tmp_path / "data" / "data.parquet", tmp_path / "data" / "saved"


def test_a_parquet_file_and_an_arrow_folder_hold_the_jsonl_s_conversations(sources):
    jsonl, parquet, folder = sources
    want = ConversationFile(jsonl)
    for table in (TableConversations(parquet), TableConversations(folder)):
        assert len(table) == len(want) == 32
        assert all(table[i].turns == want[i].turns for i in range(len(want)))
    assert TableConversations(parquet).where(3) == f"{parquet}:row 4"
    assert TableConversations(folder).only([5, 2]).where(1).endswith("data-00000-of-00001.arrow:row 3")


def test_a_bad_row_names_its_file_and_row(sources, tmp_path):
    jsonl = sources[0]
    records = _records(jsonl)
    records[4]["messages"][0]["content"][0]["path"] = "media/missing.png"  # an image
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "data" / "bad.parquet")
    with pytest.raises(BadSample, match=r"bad\.parquet:row 5: messages\[0\]\.content\[0\]: image file 'media/missing"):
        TableConversations(tmp_path / "data" / "bad.parquet")[4]


def _trainer(root, source, steps: int = 2):
    from loom.train.trainer import Trainer

    overrides = user_data_overrides(root, "--data.heldout_size=4", "--data.workers=0")
    overrides = [o for o in overrides if not o.startswith("--data.sources")]
    overrides.append(f'--data.sources=[{{path = "{source}", weight = 1.0}}]')
    t = Trainer(load_config(None, tiny_job_overrides(root / f"run-{source.stem}", *overrides)))
    return [t.train_step().loss for _ in range(steps)]


def test_a_job_on_a_parquet_source_trains_as_on_its_jsonl(sources, tmp_path):
    jsonl, parquet, _ = sources
    assert _trainer(tmp_path, parquet) == _trainer(tmp_path, jsonl)


def test_a_missing_table_is_a_config_error(tmp_path):
    missing = tmp_path / "nothing.parquet"
    with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.path = .*nothing\.parquet.*no such file"):
        load_config(None, [*user_data_overrides(tmp_path)[:1],
                           f'--data.sources=[{{path = "{missing}", weight = 1.0}}]'])


# ---------------------------------------------------------------- media embedded as `datasets` stores them


def _embedded_records(jsonl) -> list[dict]:
    """The JSONL's conversations with their media inside the rows, in the schema `datasets` writes (checked
    against datasets 5.2's save_to_disk): TRL's "images" column of Image-feature structs {bytes, path}, image
    parts {"type": "image"} with no path; clips as {"array", "sampling_rate"} (a plain-dict audio column) in
    "audios"; row 2's clip as an ASR dataset's one "audio" value; row 1's clip as an Audio feature's {bytes,
    path} inside its part."""
    import soundfile

    out = []
    for n, record in enumerate(_records(jsonl)):
        images, audios = [], []
        for m in record["messages"]:
            for part in m["content"]:
                path = part.pop("path", None)
                if part["type"] == "image":
                    images.append({"bytes": (jsonl.parent / path).read_bytes(), "path": path.split("/")[-1]})
                elif part["type"] == "audio" and n == 1:
                    part["audio"] = {"bytes": (jsonl.parent / path).read_bytes(), "path": None}
                elif part["type"] == "audio":
                    wave, rate = soundfile.read(jsonl.parent / path, dtype="float32")
                    audios.append({"array": wave.tolist(), "sampling_rate": rate})
        single = audios.pop() if n == 2 else None
        out.append({**record, "images": images, "audios": audios, "audio": single})
    return out


def test_media_embedded_in_a_parquet_file_train_as_the_jsonl_s_files(tmp_path):
    jsonl = write_user_data(tmp_path / "data")
    parquet = tmp_path / "embedded.parquet"
    records = _embedded_records(jsonl)
    pq.write_table(pa.Table.from_pylist(records), parquet, row_group_size=5)
    assert pq.ParquetFile(parquet).schema_arrow.field("images").type.value_type == pa.struct(
        [("bytes", pa.binary()), ("path", pa.string())])  # datasets' Image feature storage
    assert _trainer(tmp_path, parquet) == _trainer(tmp_path, jsonl)


def test_a_parquet_file_is_read_a_row_group_at_a_time(tmp_path, monkeypatch):
    jsonl = write_user_data(tmp_path / "data")
    parquet = tmp_path / "embedded.parquet"
    pq.write_table(pa.Table.from_pylist(_embedded_records(jsonl)), parquet, row_group_size=5)
    reads = []
    whole = lambda *a, **k: pytest.fail("a whole parquet file read into memory")  # noqa: E731
    monkeypatch.setattr(pq, "read_table", whole)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, *a, **k: reads.append(i) or group(
        self, i, *a, **k))
    table = TableConversations(parquet)
    assert table.problems() == {}  # the prescan: every row, in order
    assert reads == list(range(7))  # 32 rows in groups of 5: each group read once


def test_an_embedded_item_the_messages_do_not_place_names_its_row(tmp_path):
    jsonl = write_user_data(tmp_path / "data", n=4)
    records = _embedded_records(jsonl)
    records[0]["images"] = records[0]["images"] * 2  # two images, one {"type": "image"} part
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "bad.parquet")
    with pytest.raises(BadSample, match=r"bad\.parquet:row 1: its 'images' column holds 2 but its messages place 1"):
        TableConversations(tmp_path / "bad.parquet")[0]
