"""Conversation records from LLaVA's JSON files, WebDataset tar shards and Parquet / Arrow through
`datasets`: the same records give the same samples and images as in JSONL; bad ones are reported
by file and record, shard and key, or file and row; sample ids are stable across loads (what the
sampler's exactly-once resume relies on)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest
import torch

from dyad.data import DataConfig, DatasetError, make_dataset, read_image_processor
from dyad.router.sampler import Cursor, EpochSampler
from tests.helpers.conversations import tokenizer_dir, write_images, write_jsonl


def _turns(question: str, answer: str) -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


# (image sizes, LLaVA turns, split); the third and fifth samples' images are members whose order a
# tar fixes by name ("images" listed, or numbers compared as numbers)
RECORDS = [
    ([(9, 7)], _turns("<image>\nWhat is this?", "A cat."), "train"),
    ([(5, 12)], _turns("What is this?", "Grey."), "heldout"),  # LLaVA's leading placeholder
    ([(6, 6), (11, 4)], _turns("<image> <image>\nWhat is this?", "A cat."), "train"),
    ([], _turns("What colour?", "Grey."), "train"),
    ([(4, 9), (7, 7), (10, 3)], _turns("<image>\n<image>\n<image>\nWhat?", "A cat."), "train"),
    ([(13, 8)], _turns("<image>\nBe brief.", "A cat."), "heldout"),
]
TAR_EXTENSIONS = {2: ["b.png", "a.png"], 4: ["1.png", "2.png", "10.png"]}  # others: "png"


def _image_bytes(tmp_path) -> list[list[bytes]]:
    images = []
    for seed, (sizes, _, _) in enumerate(RECORDS):
        names = write_images(tmp_path, sizes, seed=seed)
        images.append([(tmp_path / name).read_bytes() for name in names])
    return images


def _jsonl(tmp_path, images) -> str:
    (tmp_path / "jsonl").mkdir()
    records = []
    for k, ((_, turns, split), blobs) in enumerate(zip(RECORDS, images)):
        names = [f"{k}-{i}.png" for i in range(len(blobs))]
        for name, blob in zip(names, blobs):
            (tmp_path / "jsonl" / name).write_bytes(blob)
        records.append({"images": names, "conversations": turns, "split": split})
    return str(write_jsonl(tmp_path / "jsonl" / "c.jsonl", records))


def _add(tar, name: str, data: bytes):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _shards(root, images, per_shard=2) -> str:
    """RECORDS as WebDataset shards, `per_shard` samples each; the pattern that names them."""
    root.mkdir()
    for start in range(0, len(RECORDS), per_shard):
        with tarfile.open(root / f"train-{start // per_shard:06d}.tar", "w") as tar:
            for k in range(start, min(start + per_shard, len(RECORDS))):
                _, turns, split = RECORDS[k]
                record = {"conversations": turns, "split": split}
                extensions = TAR_EXTENSIONS.get(k, ["png"] * len(images[k]))
                if k == 2:
                    record["images"] = extensions  # listed: not the sorted order
                _add(tar, f"s/{k:06d}.json", json.dumps(record).encode())
                for extension, blob in reversed(list(zip(extensions, images[k]))):  # not the tar's order
                    _add(tar, f"s/{k:06d}.{extension}", blob)
    last = (len(RECORDS) - 1) // per_shard
    return str(root / f"train-{{000000..{last:06d}}}.tar")


def _load(path, tokenizer, **kwargs):
    return make_dataset(DataConfig(name="conversations", path=str(path), tokenizer=str(tokenizer), channels=3,
                                   image_size=8, max_images_per_sample=3, **kwargs))


QWEN = {"image_processor_type": "Qwen2VLImageProcessorFast", "size": {"shortest_edge": 32 * 32, "longest_edge": 64 * 64},
        "patch_size": 8, "temporal_patch_size": 2, "merge_size": 2}


def _assert_same_samples(ours, reference, processor):
    assert len(ours) == len(reference) == len(RECORDS) and ours.heldout_ids == reference.heldout_ids == [1, 5]
    for i in range(len(reference)):
        sample, expected = ours.sample(i), reference.sample(i)
        assert (sample.text, sample.target_spans) == (expected.text, expected.target_spans)
        assert [ours.image_hw(k) for k in sample.image_ids] == [reference.image_hw(k) for k in expected.image_ids]
        assert torch.equal(ours.images(sample.image_ids), reference.images(expected.image_ids))
        for a, b in zip(ours.patches(sample.image_ids, processor), reference.patches(expected.image_ids, processor)):
            assert torch.equal(a, b)


@pytest.fixture
def processor(tmp_path):
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "preprocessor_config.json").write_text(json.dumps(QWEN))
    return read_image_processor(tmp_path / "qwen")


def _llava_json(tmp_path, images) -> str:
    """RECORDS as LLaVA ships them: one JSON list, each record's "image" one path, a list of
    paths where there are several, absent where there is none; the images beside the JSONL's."""
    records = []
    for k, ((_, turns, split), blobs) in enumerate(zip(RECORDS, images)):
        record = {"id": f"{k:03d}", "conversations": turns, "split": split}
        names = [f"{k}-{i}.png" for i in range(len(blobs))]
        if names:
            record["image"] = names[0] if len(names) == 1 else names
        records.append(record)
    (tmp_path / "jsonl" / "llava.json").write_text(json.dumps(records, indent=1))
    return str(tmp_path / "jsonl" / "llava.json")


def test_a_llava_json_file_gives_the_samples_of_the_same_records_in_jsonl(tmp_path, processor):
    tokenizer = tokenizer_dir(tmp_path / "tok")
    images = _image_bytes(tmp_path)
    reference = _load(_jsonl(tmp_path, images), tokenizer)
    _assert_same_samples(_load(_llava_json(tmp_path, images), tokenizer), reference, processor)


def test_bad_records_of_a_llava_json_file_are_reported_with_file_and_record(tmp_path):
    tokenizer = tokenizer_dir(tmp_path / "tok")
    write_images(tmp_path, [(4, 4)])
    question = "<image>\nWhat?"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([
        {"image": "RGB0.png", "conversations": _turns(question, "A cat.")},
        {"image": "missing.png", "conversations": _turns(question, "A cat.")},
        {"image": "RGB0.png", "images": ["RGB0.png"], "conversations": _turns(question, "A cat.")},
        {"image": 3, "conversations": _turns(question, "A cat.")},
        {"conversations": _turns(question, "A cat.")},  # text only: no image for its placeholder
        "a string",
    ]))
    with pytest.raises(DatasetError) as error:
        _load(bad, tokenizer)
    message = str(error.value)
    for expected in (f"{bad}:record 1: image 'missing.png' not found",
                     f"{bad}:record 2: a record has 'image' (LLaVA's) or 'images', not both",
                     f"{bad}:record 3: 'image' must be a path or a list of paths",
                     f"{bad}:record 4: 1 <image> placeholders but 0 images",
                     f"{bad}:record 5: a record must be a JSON object, got str"):
        assert expected in message, message
    assert f"{bad}:record 0" not in message, message
    bad.write_text('{"conversations": []}')
    with pytest.raises(DatasetError, match=f"{bad}: holds a dict, not a list of records"):
        _load(bad, tokenizer)
    bad.write_text('[{"conversations": [}]')
    with pytest.raises(DatasetError, match=f"{bad}: not a JSON file: Expecting value"):
        _load(bad, tokenizer)


def test_webdataset_shards_give_the_samples_of_the_same_records_in_jsonl(tmp_path, processor):
    tokenizer = tokenizer_dir(tmp_path / "tok")
    images = _image_bytes(tmp_path)
    reference = _load(_jsonl(tmp_path, images), tokenizer)
    _assert_same_samples(_load(_shards(tmp_path / "shards", images), tokenizer), reference, processor)
    assert "<|im_start|>user\n<image>\n<image>\n<image>\nWhat?" in reference.sample(4).text


def test_the_same_shards_number_their_samples_alike_so_a_resumed_epoch_takes_each_once(tmp_path):
    tokenizer = tokenizer_dir(tmp_path / "tok")
    pattern = _shards(tmp_path / "shards", _image_bytes(tmp_path), per_shard=4)
    first, second = _load(pattern, tokenizer), _load(pattern, tokenizer)
    sampler = EpochSampler(first.train_ids, seed=3)
    before = sampler.next_batch(2)
    resumed = EpochSampler(second.train_ids, seed=3, cursor=Cursor(sampler.cursor.epoch, sampler.cursor.offset))
    after = resumed.next_batch(len(first.train_ids) - 2)
    assert sorted(before + after) == first.train_ids == second.train_ids
    for i in range(len(first)):
        assert first.sample(i) == second.sample(i)
        assert torch.equal(first.images(first.sample(i).image_ids), second.images(second.sample(i).image_ids))


def test_bad_samples_in_shards_are_reported_with_shard_and_key(tmp_path):
    tokenizer = tokenizer_dir(tmp_path / "tok")
    (png,) = _image_bytes(tmp_path)[0]
    good = json.dumps({"conversations": _turns("<image>\nWhat?", "A cat.")}).encode()
    (tmp_path / "bad").mkdir()
    with tarfile.open(tmp_path / "bad" / "a.tar", "w") as tar:
        _add(tar, "000.json", good)
        _add(tar, "000.png", png)
        _add(tar, "001.json", json.dumps({"conversations": _turns("<image>", "A cat."), "images": ["jpg"]}).encode())
        _add(tar, "002.json", b"{not json")
    with tarfile.open(tmp_path / "bad" / "b.tar", "w") as tar:
        _add(tar, "003.png", png)  # no record
        _add(tar, "004.json", good)
        _add(tar, "004.jpg", b"not an image")
        _add(tar, "005.json", json.dumps({"conversations": _turns("What?", " ")}).encode())
    with pytest.raises(DatasetError) as error:
        _load(tmp_path / "bad" / "*.tar", tokenizer)
    message = str(error.value)
    a, b = tmp_path / "bad" / "a.tar", tmp_path / "bad" / "b.tar"
    for expected in (f"{a}:001: image '001.jpg' not found", f"{a}:002: 002.json: invalid JSON",
                     f"{b}:003: no 003.json: a sample needs its record", f"{b}:004: image '004.jpg' cannot be read",
                     f"{b}:005: no assistant turn with content"):
        assert expected in message, message
    assert f"{a}:000" not in message and message.startswith("5 problem(s)")


def test_shard_patterns_that_name_nothing_or_compressed_shards_are_refused_naming_data_path(tmp_path):
    tokenizer = tokenizer_dir(tmp_path / "tok")
    with tarfile.open(tmp_path / "train-000000.tar", "w") as tar:
        _add(tar, "0.json", b"{}")
    with pytest.raises(ValueError, match=r"data.path: no file matches '.*/train-000001.tar'"):
        _load(tmp_path / "train-{000000..000001}.tar", tokenizer)
    with tarfile.open(tmp_path / "z.tar", "w:gz") as tar:
        _add(tar, "0.json", b"{}")
    with pytest.raises(ValueError, match="data.path: .*z.tar is not an uncompressed tar file"):
        _load(tmp_path / "z.tar", tokenizer)
    for path in ("shards/{0..9}.tar", "llava.json"):
        with pytest.raises(ValueError, match="data.name 'jsonl' reads one JSONL file"):
            DataConfig(name="jsonl", path=path)


@pytest.fixture
def hf_datasets(tmp_path, monkeypatch):
    """`datasets`, its cache (what Dataset.from_parquet converts into) in tmp_path."""
    datasets = pytest.importorskip("datasets", reason="Parquet and Arrow are read with datasets (the parquet extra)")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    return datasets


def _table(datasets, rows: list[dict]):
    """Rows with their images as the `datasets` Image feature stores them (bytes, no path)."""
    table = datasets.Dataset.from_list([{**row, "images": [{"bytes": b, "path": None} for b in row["images"]]}
                                        for row in rows])
    return table.cast_column("images", datasets.Sequence(datasets.Image()))


def test_parquet_files_and_an_arrow_directory_give_the_samples_of_the_same_records_in_jsonl(
        tmp_path, processor, hf_datasets):
    tokenizer = tokenizer_dir(tmp_path / "tok")
    images = _image_bytes(tmp_path)
    reference = _load(_jsonl(tmp_path, images), tokenizer)
    rows = [{"conversations": turns, "split": split, "images": blobs}
            for (_, turns, split), blobs in zip(RECORDS, images)]
    (tmp_path / "parquet").mkdir()
    _table(hf_datasets, rows[:4]).to_parquet(tmp_path / "parquet" / "train-0.parquet")
    _table(hf_datasets, rows[4:]).to_parquet(tmp_path / "parquet" / "train-1.parquet")
    _assert_same_samples(_load(tmp_path / "parquet" / "train-*.parquet", tokenizer), reference, processor)
    _table(hf_datasets, rows).save_to_disk(tmp_path / "arrow")
    _assert_same_samples(_load(tmp_path / "arrow", tokenizer), reference, processor)


def test_bad_rows_are_reported_with_file_and_row(tmp_path, hf_datasets):
    tokenizer = tokenizer_dir(tmp_path / "tok")
    (png,) = _image_bytes(tmp_path)[0]
    (tmp_path / "cat.png").write_bytes(png)
    question = "<image>\nWhat?"
    hf_datasets.Dataset.from_list([  # images as paths, in the one-image column
        {"image": "cat.png", "conversations": _turns(question, "A cat.")},
        {"image": "missing.png", "conversations": _turns(question, "A cat.")},
        {"image": None, "conversations": _turns("What?", "Grey.")},
    ]).to_parquet(tmp_path / "paths.parquet")
    _table(hf_datasets, [
        {"images": [png], "conversations": _turns(question, "A cat."), "split": None},
        {"images": [png], "conversations": _turns(question, " "), "split": "train"},
        {"images": [b"not an image"], "conversations": _turns(question, "A cat."), "split": "test"},
    ]).to_parquet(tmp_path / "bytes.parquet")
    with pytest.raises(DatasetError) as error:
        _load(tmp_path / "{paths,bytes}.parquet", tokenizer)
    message = str(error.value)
    paths, blobs = tmp_path / "paths.parquet", tmp_path / "bytes.parquet"
    for expected in (f"{paths}:row 1: image 'missing.png' not found",
                     f"{blobs}:row 1: no assistant turn with content", f"{blobs}:row 2: 'split' must be one of",
                     f"{blobs}:row 2: image 'images[0]' cannot be read"):
        assert expected in message, message
    assert message.startswith("4 problem(s)"), message
