"""A fine-tuning resumed on edited SFT or preference files is said in the plan, as a pretraining resumed on another
corpus is: the run records a fingerprint of its examples as tokenized and split, and the resume compares it."""

from __future__ import annotations

import json
from types import SimpleNamespace

from hf_helpers import make_tokenizer, sft_rows

from gptoughts.data.prefs import PrefData
from gptoughts.data.sft import SFTData
from gptoughts.training.plan import _corpus_moved


def test_a_resume_on_edited_examples_is_warned(tmp_path):
    tok = make_tokenizer()
    path = sft_rows(tmp_path / "d.jsonl", 20)
    data = SimpleNamespace(
        format="sft", sft=SFTData([str(path)], tok, block_size=32, val_fraction=0.1), prefs=None
    )
    record = {"data_fingerprint": data.sft.fingerprint}
    assert _corpus_moved(data, record, start=4) == []
    assert _corpus_moved(data, {}, start=4) == []  # a run recorded before fingerprints: nothing to compare

    with open(path, "a") as f:
        f.write(json.dumps({"prompt": "add 9 9", "response": "18"}) + "\n")
    edited = SimpleNamespace(
        format="sft", sft=SFTData([str(path)], tok, block_size=32, val_fraction=0.1), prefs=None
    )
    (warning,) = _corpus_moved(edited, record, start=4)
    assert warning.startswith("the examples differ from the ones this run trained on")

    pairs = tmp_path / "p.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    prefs = SimpleNamespace(format="prefs", sft=None, prefs=PrefData([str(pairs)], tok, block_size=32))
    record = {"data_fingerprint": prefs.prefs.fingerprint}
    assert _corpus_moved(prefs, record, start=2) == []
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "d"}) + "\n")
    prefs.prefs = PrefData([str(pairs)], tok, block_size=32)
    assert len(_corpus_moved(prefs, record, start=2)) == 1
