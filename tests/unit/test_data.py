"""dyad.data: config validation, the digits dataset, sequence/batch layout, JSONL loading and
user tokenizers. Everything is offline; fixtures are written into tmp_path."""

import json
import re
from functools import cache

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder
from tokenizers.models import BPE
from tokenizers.pre_tokenizers import ByteLevel
from tokenizers.trainers import BpeTrainer

from dyad.data import (
    IGNORE_INDEX,
    DataConfig,
    DatasetError,
    FixedTokens,
    Sample,
    build_prompt,
    build_sequence,
    build_word_tokenizer,
    load_tokenizer,
    make_dataset,
)
from dyad.data.batch import collate
from dyad.data.digits import DIGIT_WORDS, load_digits

N_DIGITS = 1797


@cache
def digits(**kwargs):
    return make_dataset(DataConfig(**kwargs))


# --- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "mnist"}, "data.name must be one of ('digits', 'jsonl', 'conversations'), got 'mnist'"),
        ({"name": "jsonl"}, "data.path is required when data.name is 'jsonl'"),
        ({"path": "x.jsonl"}, "data.path is only used when data.name is one of ('jsonl', 'conversations'), got 'x.jsonl'"),
        ({"heldout_fraction": 1.5}, "data.heldout_fraction must be in (0, 1), got 1.5"),
        ({"heldout_fraction": 0.0}, "data.heldout_fraction must be in (0, 1), got 0.0"),
        ({"image_size": 0}, "data.image_size must be >= 1, got 0"),
        ({"channels": 2}, "data.channels must be 1 or 3, got 2"),
        ({"multi_image_fraction": -0.1}, "data.multi_image_fraction must be in [0, 1), got -0.1"),
        ({"text_only_fraction": 1.0}, "data.text_only_fraction must be in [0, 1), got 1.0"),
        (
            {"multi_image_fraction": 0.6, "text_only_fraction": 0.4},
            "data.multi_image_fraction + data.text_only_fraction must be < 1, got 0.6 + 0.4",
        ),
        (
            {"name": "jsonl", "path": "x.jsonl", "text_only_fraction": 0.1},
            "data.text_only_fraction applies only to data.name 'digits', got 0.1",
        ),
        ({"max_images_per_sample": 0}, "data.max_images_per_sample must be >= 1, got 0"),
        (
            {"multi_image_fraction": 0.1, "max_images_per_sample": 1},
            "data.max_images_per_sample must be >= 2 when data.multi_image_fraction > 0, got 1",
        ),
    ],
)
def test_config_rejects(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DataConfig(**kwargs)


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        DataConfig("digits")


# --- digits --------------------------------------------------------------------------------------


def test_the_bundled_digits_are_scikit_learns():
    from sklearn.datasets import load_digits as scikit_learn_digits

    pixels, labels = load_digits()
    expected_pixels, expected_labels = scikit_learn_digits(return_X_y=True)
    assert pixels.shape == (N_DIGITS, 64) and labels.shape == (N_DIGITS,)
    np.testing.assert_array_equal(pixels, expected_pixels)
    np.testing.assert_array_equal(labels, expected_labels)


def test_digits_images_and_captions():
    ds = digits()
    assert len(ds) == N_DIGITS  # no extra samples when the fractions are 0
    image_ids = sorted(i for k in range(len(ds)) for i in ds.sample(k).image_ids)
    assert image_ids == list(range(N_DIGITS))
    for k in range(len(ds)):
        sample = ds.sample(k)
        (image_id,) = sample.image_ids
        word = DIGIT_WORDS[ds.labels[image_id]]
        assert sample.text == f"<image> this is the digit {word}"
        assert sample.answer == word and sample.prompt_text == "<image> this is the digit"
    images = ds.images([0, 5, 1796])
    assert images.shape == (3, 1, 16, 16) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1 and images.max() > 0.5
    assert ds.images([]).shape == (0, 1, 16, 16)

    rgb = digits(channels=3, image_size=8)
    images = rgb.images([3, 4])
    assert images.shape == (2, 3, 8, 8)
    assert torch.equal(images[:, 0], images[:, 2])
    assert torch.allclose(images[:, 0] * 16, torch.round(images[:, 0] * 16))  # 8x8 as stored
    assert rgb.images([]).shape == (0, 3, 8, 8)


def test_digit_images_come_upsampled_on_the_device_asked_for():
    ds = digits()
    assert ds.images([0, 5], device="meta").device.type == "meta"  # never built on CPU first
    assert ds.images([], device="meta").device.type == "meta"
    assert torch.equal(ds.images([0, 5], device="cpu"), ds.images([0, 5]))
    if torch.cuda.is_available():
        torch.testing.assert_close(ds.images([0, 5, 1796], device="cuda").cpu(), ds.images([0, 5, 1796]))
    else:
        print("no CUDA device here: upsampling on a GPU is not compared with the CPU's")


def test_digits_split_is_fixed_and_disjoint():
    ds, mixed = digits(), digits(multi_image_fraction=0.2, text_only_fraction=0.1)
    assert len(ds.heldout_images) == round(0.2 * N_DIGITS)
    assert set(ds.heldout_images).isdisjoint(ds.train_images)
    assert len(ds.heldout_images) + len(ds.train_images) == N_DIGITS
    # The split is over images and fixed by seed 0: the same whatever the composition.
    assert np.array_equal(ds.heldout_images, mixed.heldout_images)
    assert np.array_equal(ds.heldout_images, make_dataset(DataConfig()).heldout_images)
    for dataset in (ds, mixed):
        assert set(dataset.train_ids).isdisjoint(dataset.heldout_ids)
        assert sorted(dataset.train_ids + dataset.heldout_ids) == list(range(len(dataset)))
        held = set(dataset.heldout_images.tolist())
        for k in dataset.heldout_ids:
            assert set(dataset.sample(k).image_ids) <= held
        for k in dataset.train_ids:
            assert held.isdisjoint(dataset.sample(k).image_ids)


def test_digits_multi_image_and_text_only_samples():
    ds = digits(multi_image_fraction=0.2, text_only_fraction=0.1, max_images_per_sample=3)
    kinds = {"text": [], "single": [], "multi": []}
    for k in range(len(ds)):
        sample = ds.sample(k)
        n = len(sample.image_ids)
        kinds["text" if n == 0 else "single" if n == 1 else "multi"].append(sample)
    assert len(kinds["single"]) == N_DIGITS
    assert abs(len(kinds["multi"]) / len(ds) - 0.2) < 0.01
    assert abs(len(kinds["text"]) / len(ds) - 0.1) < 0.01
    assert {len(s.image_ids) for s in kinds["multi"]} == {2, 3}
    for s in kinds["multi"]:
        words = [DIGIT_WORDS[ds.labels[i]] for i in s.image_ids]
        placeholders = " ".join(["<image>"] * len(words))
        expected = f"{placeholders} these are the digits {' '.join(words[:-1])} and {words[-1]}"
        assert s.text == expected and s.answer == words[-1]
        assert len(set(s.image_ids)) == len(s.image_ids)
    for s in kinds["text"]:
        m = re.fullmatch(r"the digit (after|before) (\w+) is (\w+)", s.text)
        step = 1 if m[1] == "after" else -1
        assert DIGIT_WORDS.index(m[3]) == DIGIT_WORDS.index(m[2]) + step and s.answer == m[3]
    # Both splits carry every kind; the vocabulary does not depend on the composition.
    for ids in (ds.train_ids, ds.heldout_ids):
        assert {min(len(ds.sample(k).image_ids), 2) for k in ids} == {0, 1, 2}
    assert ds.tokenizer.vocab_size == digits().tokenizer.vocab_size
    unk = ds.tokenizer._tokenizer.token_to_id("<unk>")
    assert all(unk not in ds.tokenizer.encode(ds.sample(k).text) for k in range(len(ds)))


def test_shape_matches_build_sequence():
    ds = digits(multi_image_fraction=0.2, text_only_fraction=0.1)
    for k in list(range(0, len(ds), 37)):
        ids, targets, positions = build_sequence(ds.tokenizer, ds.sample(k), FixedTokens(4))
        shape = ds.shape(k, FixedTokens(4))
        assert shape.sample_id == k and shape.n_images == len(ds.sample(k).image_ids)
        assert shape.seq_len == len(ids)
        assert shape.n_targets == sum(t != IGNORE_INDEX for t in targets)
        assert len(positions) == 4 * shape.n_images


# --- sequences and batches -----------------------------------------------------------------------


@pytest.fixture
def word_tokenizer():
    return build_word_tokenizer(["<image> a cat", "<image> <image> two dogs", "hello world"])


def test_word_tokenizer(word_tokenizer, tmp_path):
    tok = word_tokenizer
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.image_id, tok.vocab_size) == (0, 1, 2, 4, 11)
    # specials 0..4, then sorted words: a=5 cat=6 dogs=7 hello=8 two=9 world=10
    assert tok.encode("<image> a cat") == [4, 5, 6]
    assert tok.encode("<image><image>two dogs") == [4, 4, 9, 7]
    assert tok.encode("a zebra") == [5, 3]  # unknown word -> <unk>
    assert tok.decode([1, 5, 6, 2, 0]) == "a cat"
    assert build_word_tokenizer(["world hello", "dogs two cat a"]).encode("a cat") == [5, 6]
    tok.save(tmp_path / "tok.json")
    again = load_tokenizer(tmp_path / "tok.json")
    assert again.encode("<image> two dogs") == [4, 9, 7] and again.vocab_size == 11


def test_build_sequence_and_collate_by_hand(word_tokenizer):
    tok = word_tokenizer
    one = Sample(sample_id=0, image_ids=(7,), text="<image> a cat", answer="cat")
    none = Sample(sample_id=1, image_ids=(), text="hello world")
    two = Sample(sample_id=2, image_ids=(3, 5), text="<image> <image> two dogs")

    assert build_sequence(tok, none, FixedTokens(2)) == ([1, 8, 10, 2], [8, 10, 2, -100], [])
    assert build_sequence(tok, one, FixedTokens(2)) == (
        [1, 4, 4, 5, 6, 2],
        [-100, -100, 5, 6, 2, -100],
        [1, 2],
    )

    batch = collate(tok, [one, none, two], FixedTokens(2))
    assert batch.input_ids.tolist() == [
        [1, 4, 4, 5, 6, 2, 0, 0],
        [1, 8, 10, 2, 0, 0, 0, 0],
        [1, 4, 4, 4, 4, 9, 7, 2],
    ]
    assert batch.targets.tolist() == [
        [-100, -100, 5, 6, 2, -100, -100, -100],
        [8, 10, 2, -100, -100, -100, -100, -100],
        [-100, -100, -100, -100, 9, 7, 2, -100],
    ]
    assert batch.image_positions.tolist() == [1, 2, 17, 18, 19, 20]
    assert batch.image_ids == (7, 3, 5)
    assert batch.lengths.tolist() == [6, 4, 8]
    assert batch.n_targets == 9
    assert batch.input_ids.dtype == batch.targets.dtype == batch.image_positions.dtype == torch.long

    # The encoder's rows for image_ids, flattened, land on the right positions, in patch order.
    encoder_out_ND = torch.tensor(
        [[10.0 * image + patch] for image in batch.image_ids for patch in (0, 1)]
    )
    embeddings_BSD = torch.zeros(3 * 8, 1)
    embeddings_BSD[batch.image_positions] = encoder_out_ND
    embeddings_BSD = embeddings_BSD.view(3, 8)
    assert embeddings_BSD[0, 1:3].tolist() == [70, 71]
    assert embeddings_BSD[2, 1:5].tolist() == [30, 31, 50, 51]

    moved = batch.to("cpu")
    assert torch.equal(moved.input_ids, batch.input_ids) and moved.image_ids == batch.image_ids


def test_build_prompt(word_tokenizer):
    sample = Sample(sample_id=0, image_ids=(7,), text="<image> a cat", answer="cat")
    assert sample.prompt_text == "<image> a"
    assert build_prompt(word_tokenizer, sample, FixedTokens(3)) == ([1, 4, 4, 4, 5], [1, 2, 3], [6])
    with pytest.raises(ValueError, match="sample 1 has no answer"):
        build_prompt(word_tokenizer, Sample(sample_id=1, image_ids=(), text="a cat"), FixedTokens(3))


def test_sample_rejects_inconsistent_fields():
    with pytest.raises(ValueError, match="text has 1 <image> placeholders but 2 images"):
        Sample(sample_id=0, image_ids=(1, 2), text="<image> a cat")
    with pytest.raises(ValueError, match="answer 'at' must be the last word"):
        Sample(sample_id=0, image_ids=(), text="a cat", answer="at")


# --- jsonl ---------------------------------------------------------------------------------------


def write_png(path, value, size=(5, 3), mode="L"):
    path.parent.mkdir(parents=True, exist_ok=True)
    color = value if mode == "L" else (value, 0, 255 - value)
    Image.new(mode, size, color).save(path)


def write_jsonl(path, lines):
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return str(path)


def test_jsonl_loads(tmp_path):
    write_png(tmp_path / "img" / "black.png", 0)
    write_png(tmp_path / "img" / "white.png", 255, mode="RGB")
    write_png(tmp_path / "elsewhere" / "grey.png", 51)
    path = write_jsonl(
        tmp_path / "data.jsonl",
        [
            {"images": ["img/black.png"], "caption": "a black square"},
            "",
            {"images": ["img/white.png", str(tmp_path / "elsewhere" / "grey.png")],
             "caption": "<image> is white and <image> is grey", "answer": "grey"},
            {"images": [], "caption": "no picture here", "split": "heldout"},
            {"images": ["img/black.png"], "caption": "<image> black again", "split": "train"},
        ],
    )
    ds = make_dataset(DataConfig(name="jsonl", path=path, image_size=4))
    assert len(ds) == 4
    assert ds.sample(0) == Sample(sample_id=0, image_ids=(0,), text="<image> a black square")
    assert ds.sample(1).image_ids == (1, 2)
    assert ds.sample(1).prompt_text == "<image> is white and <image> is"
    assert ds.sample(2).image_ids == () and ds.sample(2).text == "no picture here"
    assert ds.sample(3).image_ids == (0,)  # the same file is one image table entry
    assert ds.heldout_ids == [2] and ds.train_ids == [0, 1, 3]

    images = ds.images([0, 1, 2])
    assert images.shape == (3, 1, 4, 4) and images.dtype == torch.float32
    assert torch.all(images[0] == 0) and torch.allclose(images[2], torch.full((1, 4, 4), 0.2))
    # RGB (255, 0, 0) as L is round(0.299 * 255) = 76
    assert torch.allclose(images[1], torch.full((1, 4, 4), 76 / 255))
    assert ds.images([]).shape == (0, 1, 4, 4)
    assert ds.images([0, 1], device="meta").device.type == "meta"

    rgb = make_dataset(DataConfig(name="jsonl", path=path, image_size=2, channels=3)).images([1])
    assert torch.allclose(rgb[0, :, 0, 0], torch.tensor([1.0, 0.0, 0.0]))

    batch = collate(ds.tokenizer, [ds.sample(k) for k in range(4)], FixedTokens(3))
    assert batch.image_ids == (0, 1, 2, 0) and len(batch.image_positions) == 12
    assert torch.all(batch.input_ids.view(-1)[batch.image_positions] == ds.tokenizer.image_id)


def test_jsonl_holds_out_a_fixed_fraction_without_split_field(tmp_path):
    write_png(tmp_path / "a.png", 10)
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"images": ["a.png"], "caption": f"number {i}"} for i in range(10)]
    )
    first = make_dataset(DataConfig(name="jsonl", path=path, heldout_fraction=0.3))
    again = make_dataset(DataConfig(name="jsonl", path=path, heldout_fraction=0.3))
    assert len(first.heldout_ids) == 3 and first.heldout_ids == again.heldout_ids
    assert sorted(first.train_ids + first.heldout_ids) == list(range(10))


def test_jsonl_reports_every_bad_record(tmp_path):
    write_png(tmp_path / "ok.png", 100)
    (tmp_path / "broken.png").write_bytes(b"this is not a png")
    path = write_jsonl(
        tmp_path / "data.jsonl",
        [
            {"images": ["ok.png"], "caption": "fine"},  # 1
            '{"images": ["ok.png"], "caption": ',  # 2
            {"images": ["ok.png"]},  # 3
            {"caption": "no images field"},  # 4
            {"images": ["cat.png"], "caption": "a cat"},  # 5
            {"images": ["broken.png"], "caption": "a broken file"},  # 6
            {"images": ["ok.png"], "caption": "  "},  # 7
            {"images": ["ok.png"], "caption": "<image> and <image>"},  # 8
            "",  # 9: blank lines are skipped
            {"images": ["ok.png"], "caption": "fine", "split": "test"},  # 10
            {"images": ["ok.png"] * 3, "caption": "three"},  # 11
            [1, 2],  # 12
            {"images": ["ok.png"], "caption": "a cat", "answer": "dog"},  # 13
            {"images": "ok.png", "caption": "a cat"},  # 14
        ],
    )
    with pytest.raises(DatasetError) as info:
        make_dataset(DataConfig(name="jsonl", path=path))
    message = str(info.value)
    expected = [
        f"{path}:2: invalid JSON: ",
        f"{path}:3: missing field 'caption'",
        f"{path}:4: missing field 'images'",
        f"{path}:5: image 'cat.png' not found",
        f"{path}:6: image 'broken.png' cannot be read: ",
        f"{path}:7: empty caption",
        f"{path}:8: caption has 2 <image> placeholders but 1 images",
        f"{path}:10: 'split' must be one of ('train', 'heldout'), got 'test'",
        f"{path}:11: 3 images, more than data.max_images_per_sample=2",
        f"{path}:12: a record must be a JSON object, got list",
        f"{path}:13: 'answer' 'dog' must be the caption's last word(s)",
        f"{path}:14: 'images' must be a list of strings",
    ]
    for line in expected:
        assert line in message
    assert f"{path}:1:" not in message and f"{path}:9:" not in message
    assert isinstance(info.value, ValueError)


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(ValueError, match="data.path: file not found: '.*nope.jsonl'"):
        make_dataset(DataConfig(name="jsonl", path=str(tmp_path / "nope.jsonl")))


# --- user tokenizers -----------------------------------------------------------------------------


def test_user_bpe_tokenizer_offline(tmp_path):
    corpus = [f"this is the digit {w}" for w in DIGIT_WORDS] * 20
    bpe = Tokenizer(BPE(unk_token=None))
    bpe.pre_tokenizer = ByteLevel(add_prefix_space=False)
    bpe.decoder = ByteLevelDecoder()
    bpe.train_from_iterator(
        corpus,
        BpeTrainer(vocab_size=300, initial_alphabet=ByteLevel.alphabet(), show_progress=False),
    )
    assert bpe.token_to_id("<image>") is None
    n_before = bpe.get_vocab_size()
    bpe.save(str(tmp_path / "tokenizer.json"))

    ds = make_dataset(DataConfig(tokenizer=str(tmp_path / "tokenizer.json")))
    tok = ds.tokenizer
    assert tok.vocab_size == n_before + 4  # <pad>, <bos>, <eos>, <image> added
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.image_id}) == 4
    assert tok.encode("<image><image> this")[:2] == [tok.image_id, tok.image_id]
    assert tok.decode(tok.encode("this is the digit seven")) == "this is the digit seven"

    sample = ds.sample(0)
    ids, targets, positions = build_sequence(tok, sample, FixedTokens(4))
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and positions == [1, 2, 3, 4]
    assert tok.decode(ids) == sample.text.replace("<image>", "")  # specials skipped
    prompt_ids, _, answer_ids = build_prompt(tok, sample, FixedTokens(4))
    assert prompt_ids + answer_ids + [tok.eos_id] == ids
    assert tok.decode(answer_ids).strip() == sample.answer


@pytest.mark.parametrize("content", [None, "{not json"])
def test_bad_tokenizer_file(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"data.tokenizer: .*{re.escape(repr(str(path)))}"):
        make_dataset(DataConfig(tokenizer=str(path)))
