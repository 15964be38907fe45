"""The byte tokenizer, and its tokenizer.json twin, id for id."""

from __future__ import annotations

import pytest

from kvtransfer.engine.model.tokenizer import Tokenizer, byte_level_tokenizer_json

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Tokenizer, Tokenizer]:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(byte_level_tokenizer_json())
    from_file = Tokenizer.from_file(path, eos_token_ids=[257], bos_token_id=256, pad_token_id=258)
    return Tokenizer.byte_level(), from_file


def test_bytes_are_their_own_ids():
    tokenizer = Tokenizer.byte_level()
    assert tokenizer.encode("Hi ü") == [72, 105, 32, 0xC3, 0xBC]
    assert tokenizer.decode([72, 105, 32, 0xC3, 0xBC]) == "Hi ü"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        256,
        257,
        258,
    )
    assert tokenizer.vocab_size == 259


@pytest.mark.parametrize(
    "text",
    [
        "plain ASCII text.",
        "  leading and  double spaces\n",
        "ñ€𝄞 mixed 日本",
        "a<eos>b<pad><bos>",
        "",
    ],
)
def test_both_encode_and_decode_identically(pair, text):
    byte_level, from_file = pair
    ids = byte_level.encode(text)
    assert from_file.encode(text) == ids
    assert byte_level.decode(ids) == from_file.decode(ids)
    assert byte_level.decode(ids, skip_special_tokens=False) == from_file.decode(
        ids, skip_special_tokens=False
    )


def test_special_tokens_are_skipped_or_spelled(pair):
    for tokenizer in pair:
        assert tokenizer.encode("<eos>") == [257]
        assert tokenizer.decode([104, 256, 105, 257]) == "hi"
        assert tokenizer.decode([104, 256, 105], skip_special_tokens=False) == "h<bos>i"


def test_partial_utf8_decodes_with_replacement(pair):
    ids = Tokenizer.byte_level().encode("日本")[:-1]  # cut inside the second character
    for tokenizer in pair:
        assert tokenizer.decode(ids) == "日\ufffd"


def test_ids_outside_the_vocabulary_are_rejected(pair):
    for tokenizer in pair:
        with pytest.raises(ValueError, match=r"token id 259 is outside the vocabulary \[0, 259\)"):
            tokenizer.decode([1, 259])
    with pytest.raises(ValueError, match=r"special token id 300 is outside the vocabulary"):
        Tokenizer(None, vocab_size=259, eos_token_ids=[300])
