"""The megatron data pipeline: stem-preprocess -> indexed dataset -> GPTDataset / blend -> DP micro-batches,
cross-document masking in the model, and clear errors for damaged files and out-of-vocabulary ids."""

import json
import re
import shutil
import string
import tempfile
from pathlib import Path

import distributed
import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import VOCAB
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from torch.distributed.elastic.utils.distributed import get_free_port

from stem_megatron.config import ConfigError, DataConfig, RunConfig, validate
from stem_megatron.data.batches import micro_batches
from stem_megatron.data.datasets import build_datasets
from stem_megatron.data.integrity import check_indexed_dataset
from stem_megatron.data.preprocess import main as preprocess_main
from stem_megatron.data.preprocess import preprocess
from stem_megatron.data.tokenizer import HFTokenizer, train_tokenizer


@pytest.fixture(scope="module")
def world_of_one():
    """build_datasets is collective: a one-rank gloo group (torn down so other modules see none)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{get_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tok(corpus):
    return HFTokenizer(corpus / "tokenizer.json")


def _docs(seed, n, alphabet=string.ascii_lowercase, sep=" "):
    rng = np.random.default_rng(seed)
    return [sep.join("".join(rng.choice(list(alphabet), rng.integers(1, 6))) for _ in range(rng.integers(3, 40)))
            for _ in range(n)]


def _packed_stream(dataset):
    """Token stream of the samples in megatron's packing order (before its shuffle), and the samples."""
    order = np.argsort(np.asarray(dataset.shuffle_index))
    samples = [dataset[int(i)] for i in order]
    return torch.cat([s["tokens"] for s in samples] + [samples[-1]["labels"][-1:]]).tolist(), samples


def test_tokenizer_wraps_tokenizer_json_for_megatron(tok):
    assert tok.eod == 0 and tok.pad == -1  # no pad token: megatron's sentinel
    assert tok.inv_vocab[tok.vocab["<|endoftext|>"]] == "<|endoftext|>"
    assert tok.vocab_size == len(tok.vocab) == len(tok.inv_vocab) <= VOCAB
    text = "def f(x):\n\treturn x ** 2  # naïve Ω"
    assert tok.detokenize(np.array(tok.tokenize(text), dtype=np.uint16)) == text
    assert tok.tokenize_batch([text, "the"]) == [tok.tokenize(text), tok.tokenize("the")]
    assert "tokenizer.json" in json.dumps(tok.unique_identifiers)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="stem-preprocess --vocab-size"):
        HFTokenizer(tmp_path / "none.json")


@pytest.mark.parametrize("fmt", ["jsonl", "text"])
def test_preprocess_to_packed_samples_round_trip(fmt, corpus, tok, tmp_path, world_of_one):
    """Documents come back, in megatron's document order, from the packed samples, EOD after each."""
    docs = _docs(1, 30)
    if fmt == "jsonl":
        (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"id": i, "body": d}) for i, d in enumerate(docs[:20]))
                                          + "\n\n")
        (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs[20:]))
        args = ["--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--text-key", "body"]
    else:
        (tmp_path / "in").mkdir()
        for i, d in enumerate(docs):
            (tmp_path / "in" / f"{i:03d}.md").write_text(d)
        (tmp_path / "in" / "skip.txt").write_text("not matched by the pattern")
        args = ["--input", str(tmp_path / "in"), "--pattern", "*.md"]
    prefix = tmp_path / "out" / "ds"
    preprocess_main([*args, "--output-prefix", str(prefix), "--tokenizer", str(corpus / "tokenizer.json")])
    # the tokenizer now beside the data (what data.dir/tokenizer.json a run reads)
    assert (prefix.parent / "tokenizer.json").read_bytes() == (corpus / "tokenizer.json").read_bytes()

    indexed = IndexedDataset(str(prefix))
    assert [indexed[i].tolist() for i in range(len(indexed))] == [tok.tokenize(d) + [tok.eod] for d in docs]
    assert check_indexed_dataset(prefix, VOCAB) == sum(len(tok.tokenize(d)) + 1 for d in docs)

    train, _ = build_datasets(tok, [(1.0, prefix)], seq_length=16, train_samples=10, seed=5,
                              cache_dir=tmp_path / "cache", vocab_size=VOCAB)
    stream, samples = _packed_stream(train)
    for s in samples:
        assert torch.equal(s["tokens"][1:], s["labels"][:-1])  # labels are the next tokens
    expected = [t for d in np.asarray(train.document_index) for t in tok.tokenize(docs[d]) + [tok.eod]]
    assert len(expected) - 16 < len(stream) <= len(expected)  # one epoch; only a partial last sample dropped
    assert stream == expected[: len(stream)]
    pieces = np.split(np.array(stream), np.flatnonzero(np.array(stream) == tok.eod) + 1)
    complete = [tok.detokenize(p[:-1]) for p in pieces if len(p) and p[-1] == tok.eod]
    assert complete == [docs[d] for d in np.asarray(train.document_index)[: len(complete)]]


def test_preprocess_trains_a_tokenizer_and_refuses_to_replace_it(tmp_path):
    docs = _docs(2, 40)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    stats = preprocess([tmp_path / "d.jsonl"], tmp_path / "out" / "train", vocab_size=300)
    assert stats["docs"] == 40
    tok = HFTokenizer(tmp_path / "out" / "tokenizer.json")
    ds = IndexedDataset(str(tmp_path / "out" / "train"))
    assert [tok.detokenize(ds[i][:-1]) for i in range(len(ds))] == docs
    with pytest.raises(FileExistsError, match="pass --tokenizer"):
        preprocess([tmp_path / "d.jsonl"], tmp_path / "out" / "more", vocab_size=300)
    with pytest.raises(ValueError, match="exactly one of --tokenizer"):
        preprocess([tmp_path / "d.jsonl"], tmp_path / "x", tokenizer=tmp_path / "out" / "tokenizer.json",
                   vocab_size=300)
    (tmp_path / "other").mkdir()
    train_tokenizer(docs, 280, tmp_path / "other" / "tokenizer.json")
    with pytest.raises(ValueError, match=r"out/tokenizer\.json is another tokenizer than .*other/tokenizer\.json: "
                                         "the datasets of one data dir share one tokenizer"):
        preprocess([tmp_path / "d.jsonl"], tmp_path / "out" / "more", tokenizer=tmp_path / "other" / "tokenizer.json")


def test_llama3_end_of_text_separates_documents(tmp_path):
    """A Llama 3 tokenizer has ``<|end_of_text|>``, not ``<|endoftext|>``: it is the documents' EOD."""
    from tokenizers import Tokenizer, models

    words = {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "a": 2}
    Tokenizer(models.WordLevel(words, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    assert (tok.eod, tok.eod_token) == (1, "<|end_of_text|>")


@pytest.mark.parametrize("content, message", [
    ('{"text": "a"}\n{"body": "b"}\n',
     r"d\.jsonl:2 has no string field 'text' \(found \['body'\]\); choose the field with --text-key"),
    ('{"text": "a"}\nnot json\n', r"d\.jsonl:2 is not a JSON object"),
])
def test_preprocess_bad_jsonl_names_file_line_and_fix(content, message, tmp_path, corpus, capsys):
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(SystemExit):
        preprocess_main(["--input", str(tmp_path / "d.jsonl"), "--output-prefix", str(tmp_path / "o"),
                         "--tokenizer", str(corpus / "tokenizer.json")])
    assert capsys.readouterr().err.startswith("stem-preprocess: error:")
    with pytest.raises(ValueError, match=message):
        preprocess([tmp_path / "d.jsonl"], tmp_path / "o", tokenizer=corpus / "tokenizer.json")


def test_blend_weights_are_honoured(corpus, tok, tmp_path, world_of_one):
    """Three sources at 65/5/30: shares over 3000 samples and over the first 200 within 2 points; each
    sample's tokens come from the source megatron says it does."""
    alphabets = ["abcdefgh", "stuvwxyz", "ijklmnop"]
    token_sets = []
    for k, alphabet in enumerate(alphabets):
        docs = _docs(10 + k, 60, alphabet, sep="")  # no spaces: no token shared between sources
        (tmp_path / f"s{k}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        preprocess([tmp_path / f"s{k}.jsonl"], tmp_path / f"s{k}", tokenizer=corpus / "tokenizer.json")
        token_sets.append({t for d in docs for t in tok.tokenize(d)})
    assert not (token_sets[0] & token_sets[1] or token_sets[1] & token_sets[2] or token_sets[0] & token_sets[2])
    blend = [(65, tmp_path / "s0"), (5, tmp_path / "s1"), (30, tmp_path / "s2")]
    train, _ = build_datasets(tok, blend, seq_length=8, train_samples=3000, seed=3, cache_dir=tmp_path / "cache",
                              vocab_size=VOCAB)
    assert len(train) == 3000
    samples = [train[i] for i in range(3000)]
    ids = np.array([int(s["dataset_id"]) for s in samples])
    for n in (200, 3000):
        shares = np.bincount(ids[:n], minlength=3) / n
        assert np.abs(shares - [0.65, 0.05, 0.30]).max() < 0.02, shares
    for s, k in zip(samples, ids):
        assert set(s["tokens"].tolist()) - {tok.eod} <= token_sets[k]


def _build_corpus_datasets(corpus, tok, cache, **flags):
    return build_datasets(tok, [(1, corpus / "train")], seq_length=16, train_samples=200, seed=9, cache_dir=cache,
                          vocab_size=VOCAB, valid_prefixes=[corpus / "valid"], **flags)


def test_document_resets_in_samples(corpus, tok, tmp_path, world_of_one):
    """Positions restart at 0 after every EOD, attention stays inside a document, EOD inputs leave the loss."""
    plain, valid = _build_corpus_datasets(corpus, tok, tmp_path / "cache")
    reset, _ = _build_corpus_datasets(corpus, tok, tmp_path / "cache", reset_position_ids=True,
                                      reset_attention_mask=True, eod_mask_loss=True)
    assert len(valid) > 0 and "attention_mask" not in plain[0]
    crossing = 0
    for i in range(len(reset)):
        a, b = plain[i], reset[i]
        assert torch.equal(a["tokens"], b["tokens"])  # the flags change masks only, not the packing
        tokens = b["tokens"].tolist()
        doc = np.cumsum([0] + [t == tok.eod for t in tokens[:-1]])  # document of each position
        start = [doc.tolist().index(d) for d in doc]
        assert b["position_ids"].tolist() == [p - s for p, s in zip(range(16), start)]
        allowed = torch.tensor((doc[:, None] == doc[None, :]) & np.tri(16, dtype=bool))
        assert torch.equal(b["attention_mask"][0], ~allowed)  # True = masked
        assert b["loss_mask"].tolist() == [float(t != tok.eod) for t in tokens]
        assert a["position_ids"].tolist() == list(range(16)) and a["loss_mask"].sum() == 16
        crossing += doc[-1] > 0
    assert crossing >= 5  # the check covered samples spanning documents


def _cross_document_logits(corpus):
    """Runs in a one-rank megatron world: a tiny STEM GPT on a packed sample spanning two documents."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.enums import AttnMaskType

    from stem_megatron.config import ModelConfig, ParallelConfig, STEMConfig
    from stem_megatron.layer_plan import planned_layers
    from stem_megatron.model.gpt import build_gpt, transformer_config
    from stem_megatron.model.specs import decoder_block_spec, device_rows, stem_mlp_spec
    from stem_megatron.model.token_context import token_ids

    tok = HFTokenizer(corpus / "tokenizer.json")
    seq = 32
    with tempfile.TemporaryDirectory() as cache:
        train, _ = build_datasets(tok, [(1, corpus / "train")], seq_length=seq, train_samples=50, seed=1,
                                  cache_dir=cache, vocab_size=VOCAB, reset_position_ids=True,
                                  reset_attention_mask=True)
        sample = next(s for s in (train[i] for i in range(50))
                      if (s["tokens"][4:-8] == tok.eod).sum() == 1 and (s["tokens"] == tok.eod).sum() == 1)
    tokens, positions, mask = sample["tokens"][None], sample["position_ids"][None], sample["attention_mask"][None]
    eod = int((tokens[0] == tok.eod).nonzero())
    other = tokens.clone()
    other[0, :eod] = torch.randint(1, VOCAB, (eod,), generator=torch.Generator().manual_seed(0))  # new document 1

    model_cfg = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                            vocab_size=VOCAB, seq_length=seq)
    stem = STEMConfig(variant="stem", ratio="1/2")
    config = transformer_config(model_cfg, ParallelConfig(), on_gpu=False)
    causal = build_gpt(model_cfg, stem, config).eval()
    spec = decoder_block_spec(config, planned_layers(model_cfg.num_layers, stem),
                              stem_mlp_spec("stem", VOCAB, device_rows()), attn_mask_type=AttnMaskType.arbitrary)
    arbitrary = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=seq,
                         share_embeddings_and_output_weights=False, position_embedding_type="rope").eval()
    arbitrary.load_state_dict(causal.state_dict())

    def logits(model, t, p, m):  # [s, V] of the single sequence
        with torch.no_grad(), token_ids(t, VOCAB):
            return model(t, p, m)[0]

    doc2 = tokens[:, eod + 1:]
    return {
        "eod": eod, "positions": positions[0].tolist(),
        "mask_types": [layer.self_attention.core_attention.attn_mask_type
                       for model in (causal, arbitrary) for layer in model.decoder.layers],
        "masked": logits(causal, tokens, positions, mask), "masked_other": logits(causal, other, positions, mask),
        "plain": logits(causal, tokens, positions, None), "plain_other": logits(causal, other, positions, None),
        "arbitrary": logits(arbitrary, tokens, positions, mask),
        "arbitrary_other": logits(arbitrary, other, positions, mask),
        "doc2_alone": logits(causal, doc2, torch.arange(doc2.shape[1])[None], None),
    }


@pytest.mark.slow
def test_cross_document_masking_blocks_attention_across_documents(corpus):
    r = distributed.run(_cross_document_logits, 1, corpus)[0]
    eod, doc2 = r["eod"], slice(r["eod"] + 1, None)
    assert [t.name for t in r["mask_types"]] == ["causal"] * 2 + ["arbitrary"] * 2
    assert r["positions"][eod + 1] == 0 and r["positions"][eod] == eod
    # masked: document 2's logits ignore document 1 entirely and equal document 2 run on its own
    assert torch.allclose(r["masked"][doc2], r["masked_other"][doc2], atol=1e-5)
    assert torch.allclose(r["masked"][doc2], r["doc2_alone"], atol=1e-4)
    # with megatron's "arbitrary" mask type (needed for fused / TE attention on GPU) too, and identically
    assert torch.allclose(r["arbitrary"][doc2], r["arbitrary_other"][doc2], atol=1e-5)
    assert torch.allclose(r["arbitrary"], r["masked"], atol=1e-5)
    # without the mask document 2 sees document 1
    assert (r["plain"][doc2] - r["plain_other"][doc2]).abs().max() > 1e-3
    assert not torch.allclose(r["masked"][: eod + 1], r["masked_other"][: eod + 1])  # document 1 did change


def _damage(prefix, how):
    idx, bin_ = prefix.with_suffix(".idx"), prefix.with_suffix(".bin")
    if how == "no_idx":
        idx.unlink()
    elif how == "no_bin":
        bin_.unlink()
    elif how == "idx_header_cut":
        idx.write_bytes(idx.read_bytes()[:20])
    elif how == "idx_body_cut":
        idx.write_bytes(idx.read_bytes()[:-8])
    elif how == "idx_magic":
        idx.write_bytes(b"NOTANIDX!" + idx.read_bytes()[9:])
    elif how == "idx_version":
        data = bytearray(idx.read_bytes())
        data[9] = 2
        idx.write_bytes(bytes(data))
    elif how == "bin_cut":
        bin_.write_bytes(bin_.read_bytes()[:-6])
    elif how == "bin_extra":
        bin_.write_bytes(bin_.read_bytes() + b"\0\0")


DAMAGE = [
    ("no_idx", r"train\.idx: missing"),
    ("no_bin", r"train\.bin: missing"),
    ("idx_header_cut", r"train\.idx: truncated header: 20 bytes"),
    ("idx_body_cut", r"train\.idx: truncated: \d+ bytes, but its header \(\d+ sequences"),
    ("idx_magic", r"train\.idx: corrupt header: magic b'NOTANIDX!'"),
    ("idx_version", r"train\.idx: corrupt header: version 2"),
    ("bin_cut", r"train\.bin: truncated: \d+ bytes, but train\.idx \(\d+ uint16 tokens\) implies"),
    ("bin_extra", r"train\.bin: corrupt: \d+ bytes, but train\.idx"),
]


@pytest.mark.parametrize("how, message", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged_dataset_names_file_problem_and_fix(how, message, corpus, tok, tmp_path, world_of_one):
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    _damage(data / "train", how)
    fix = r".*re-run stem-preprocess"
    with pytest.raises(ValueError, match=message + fix):
        check_indexed_dataset(data / "train")
    with pytest.raises(ValueError, match=message + fix):
        build_datasets(tok, [(1, data / "train")], 16, 10, 1, tmp_path / "cache", VOCAB)
    cfg = RunConfig(data=DataConfig(dir=str(data), vocab_size=VOCAB))
    cfg.model.vocab_size = VOCAB
    with pytest.raises(ConfigError, match=r"^data\.blend: .*" + message + fix):
        validate(cfg, 1)
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_out_of_vocabulary_ids_fail_when_the_dataset_opens(corpus, tok, tmp_path, world_of_one):
    with pytest.raises(ValueError, match=r"train\.bin: token id \d+ at position \d+ is >= vocab_size 100 .*"
                                         r"re-run stem-preprocess with this run's tokenizer"):
        build_datasets(tok, [(1, corpus / "train")], 16, 10, 1, tmp_path / "cache", vocab_size=100)


def test_data_config_validation(corpus):
    def cfg(**data):
        run = RunConfig(data=DataConfig(dir=str(corpus), vocab_size=VOCAB, **data))
        run.model.vocab_size = VOCAB
        return run

    validate(cfg(blend=[[65, "train"], [35, str(corpus / "valid")]]), 1)  # relative and absolute prefixes
    for blend, field, message in [([[0, "train"]], r"data\.blend\[0\]", "must be a number > 0"),
                                  ([["train", 1]], r"data\.blend\[0\]", "is not a \\[weight, prefix\\] pair"),
                                  ([], r"data\.blend", "is empty"),
                                  ([[1, "train"], [1, "absent"]], r"data\.blend", r"absent\.idx: missing")]:
        with pytest.raises(ConfigError, match=rf"^{field}: .*{message}"):
            validate(cfg(blend=blend), 1)
    with pytest.raises(ConfigError, match=r"^data\.valid_prefixes: .*nope\.idx: missing"):
        validate(cfg(valid_prefixes=["nope"]), 1)
    with pytest.raises(ConfigError, match=r"^data\.dir: .*tokenizer\.json is missing: `make setup` builds the demo"):
        validate(RunConfig(data=DataConfig(dir=str(corpus / "absent"))), 1)


def test_data_recipes_compose():
    from hydra import compose, initialize_config_dir

    from stem_megatron.config import to_run_config
    from stem_megatron.recipes import RECIPES

    with initialize_config_dir(config_dir=RECIPES, version_base=None):
        default = to_run_config(compose("train"))
        mix = to_run_config(compose("train", overrides=["data=midtrain_mix", "data.reset_attention_mask=true"]))
    assert default.data == DataConfig()
    assert [w for w, _ in mix.data.train_blend()] == [65, 5, 30] and mix.data.reset_attention_mask
    assert mix.data.train_blend()[2][1].endswith("data_cache/python-doc/stdlib-code")


def _parts(corpus, out) -> list[str]:
    """The corpus's train documents as three parts of unequal size, named as preprocessing across nodes names them."""
    docs = IndexedDataset(str(corpus / "train"))
    out.mkdir()
    bounds = [0, 2, 5, len(docs)]
    for k in range(3):
        builder = IndexedDatasetBuilder(str(out / f"train-{k:05d}-of-00003.bin"), dtype=docs.index.dtype)
        for i in range(bounds[k], bounds[k + 1]):
            builder.add_document(docs[i], [len(docs[i])])
        builder.finalize(str(out / f"train-{k:05d}-of-00003.idx"))
    (out / "notes.txt").write_text("not a dataset")
    return [str(out / f"train-{k:05d}-of-00003") for k in range(3)]


def test_blend_directory_and_glob_give_the_parts_by_tokens(corpus, tok, tmp_path, world_of_one):
    """A directory or glob entry is its parts, its weight split by their tokens: megatron builds the same blend as
    from the parts listed with their token counts as weights, sample for sample."""
    parts = _parts(corpus, tmp_path / "dclm")
    tokens = [check_indexed_dataset(p) for p in parts]
    assert len(set(tokens)) == 3
    for entry in ("dclm", "dclm/", "dclm/train-*", "dclm/*.idx", str(tmp_path / "dclm" / "train-0000?-of-00003")):
        blend = DataConfig(dir=str(tmp_path), blend=[[3, entry]]).train_blend()
        assert [p for _, p in blend] == parts, entry
        assert [w for w, _ in blend] == pytest.approx([3 * n / sum(tokens) for n in tokens], rel=1e-12)
    by_dir, listed = (build_datasets(tok, blend, seq_length=16, train_samples=300, seed=4, cache_dir=tmp_path / "cache",
                                     vocab_size=VOCAB)[0]
                      for blend in (DataConfig(dir=str(tmp_path), blend=[[3, "dclm/"]]).train_blend(),
                                    list(zip(tokens, parts))))
    assert [d.dataset.path_prefix for d in by_dir.datasets] == parts
    assert [d.dataset.path_prefix for d in listed.datasets] == parts
    assert by_dir.weights == pytest.approx(listed.weights, rel=1e-12)
    assert all(torch.equal(by_dir[i]["tokens"], listed[i]["tokens"]) for i in range(300))


def test_blend_mixes_a_directory_with_prefixes(corpus, tok, tmp_path, world_of_one):
    """``[[65, dclm], [35, valid]]``: the parts share 65 by their tokens, ``valid`` keeps 35, in megatron's draw too."""
    parts = _parts(corpus, tmp_path / "dclm")
    tokens = np.array([check_indexed_dataset(p) for p in parts])
    data = DataConfig(dir=str(corpus), vocab_size=VOCAB, blend=[[65, str(tmp_path / "dclm")], [35, "valid"]])
    blend = data.train_blend()
    assert [p for _, p in blend] == parts + [str(corpus / "valid")]
    assert [w for w, _ in blend] == pytest.approx([*(65 * tokens / tokens.sum()), 35], rel=1e-12)
    run = RunConfig(data=data)
    run.model.vocab_size = VOCAB
    validate(run, 1)
    train, _ = build_datasets(tok, blend, seq_length=8, train_samples=1000, seed=2, cache_dir=tmp_path / "cache",
                              vocab_size=VOCAB)
    shares = np.bincount([int(train[i]["dataset_id"]) for i in range(1000)], minlength=4) / 1000
    assert np.abs(shares - [*(0.65 * tokens / tokens.sum()), 0.35]).max() < 0.01, shares


def test_blend_pattern_matching_nothing_names_entry_pattern_and_fix(corpus, tmp_path):
    """A pattern or directory with no dataset, one of empty datasets, a damaged part: one line naming the entry."""
    parts = _parts(corpus, tmp_path / "dclm")
    (tmp_path / "empty").mkdir()
    shutil.copy(corpus / "tokenizer.json", tmp_path)
    Path(parts[1] + ".bin").unlink()
    fix = "correct the pattern or data.dir, or write the parts there with stem-preprocess"
    for entry, searched in (("dclm/valid-*", tmp_path / "dclm" / "valid-*.idx"),
                            ("empty/", tmp_path / "empty" / "*.idx"), ("absent/", tmp_path / "absent" / "*.idx")):
        run = RunConfig(data=DataConfig(dir=str(tmp_path), blend=[[1, str(corpus / "train")], [1, entry]]))
        with pytest.raises(ConfigError) as e:
            validate(run, 1)
        assert str(e.value) == f"data.blend[1]: {entry!r} matches no .idx file (searched {searched}): {fix}"
    IndexedDatasetBuilder(str(tmp_path / "empty" / "part.bin"), dtype=np.uint16).finalize(
        str(tmp_path / "empty" / "part.idx"))  # no documents
    with pytest.raises(ConfigError, match=r"^data\.blend\[0\]: 'empty' matches empty datasets only \(searched "):
        validate(RunConfig(data=DataConfig(dir=str(tmp_path), blend=[[1, "empty"]])), 1)
    run = RunConfig(data=DataConfig(dir=str(tmp_path), blend=[[1, "dclm/train-*"]]))
    missing = rf"^data\.blend\[0\]: {re.escape(parts[1])}\.bin: missing; re-run stem-preprocess"
    with pytest.raises(ConfigError, match=missing):
        validate(run, 1)


def _rank_samples(corpus, cache):
    """Every rank builds the blended train dataset; megatron writes the index cache on rank 0 only."""
    tok = HFTokenizer(corpus / "tokenizer.json")
    train, valid = build_datasets(tok, [(3, corpus / "train"), (1, corpus / "valid")], 8, 64, 2, cache, VOCAB,
                                  valid_prefixes=[corpus / "valid"])
    return dist.get_rank(), torch.stack([train[i]["tokens"] for i in range(64)]), len(valid)


@pytest.mark.slow
def test_ranks_build_identical_datasets_from_one_cache(corpus, tmp_path):
    (rank0, tokens0, valid0), (rank1, tokens1, valid1) = distributed.run(_rank_samples, 2, corpus, tmp_path)
    assert (rank0, rank1) == (0, 1) and torch.equal(tokens0, tokens1) and valid0 == valid1 > 0
    [cache] = list(tmp_path.iterdir())  # one digest directory
    assert sorted(f.name.split("-", 1)[1] for f in cache.glob("*.npy")) == sorted(
        ["BlendedDataset-train-dataset_index.npy", "BlendedDataset-train-dataset_sample_index.npy"]
        + [f"GPTDataset-{split}-{kind}_index.npy" for split in ("train", "train", "valid")
           for kind in ("document", "sample", "shuffle")])


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


@pytest.mark.parametrize("num_micro_batches", [1, 3])
def test_micro_batches_dp_split_and_resume(corpus, tok, tmp_path, world_of_one, num_micro_batches):
    """DP=2 micro-batches side by side are DP=1's; step g holds samples [g*GB, (g+1)*GB); resuming equals continuing."""
    gb, steps = 4 * num_micro_batches, 6
    train, _ = build_datasets(tok, [(1, corpus / "train")], 8, steps * gb, 4, tmp_path / "cache", VOCAB,
                              reset_position_ids=True, reset_attention_mask=True)
    n = steps * num_micro_batches
    single = _take(micro_batches(train, 4, 0, 1, num_micro_batches=num_micro_batches), n)
    ranks = [_take(micro_batches(train, 2, r, 2, num_micro_batches=num_micro_batches), n) for r in (0, 1)]
    keys = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
    for whole, half0, half1 in zip(single, *ranks):
        assert whole["tokens"].shape == (4, 8) and whole["attention_mask"].shape == (4, 1, 8, 8)
        for key in keys:
            assert torch.equal(whole[key], torch.cat([half0[key], half1[key]]))
    flat = torch.cat([b["tokens"] for b in single])
    assert torch.equal(flat, torch.stack([train[i]["tokens"] for i in range(steps * gb)]))
    skip = 2 * num_micro_batches  # the micro-batches of steps 0 and 1
    resumed = _take(micro_batches(train, 2, 1, 2, start_step=2, num_micro_batches=num_micro_batches), n - skip)
    for a, b in zip(ranks[1][skip:], resumed, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in keys)


def test_micro_batches_past_the_dataset_fail_clearly(corpus, tok, tmp_path, world_of_one):
    train, _ = build_datasets(tok, [(1, corpus / "train")], 8, 10, 4, tmp_path / "cache", VOCAB)
    batches = micro_batches(train, 4, 0, 1, start_step=len(train) // 4)
    with pytest.raises(IndexError, match=r"needs samples up to \d+ but the dataset has \d+: build it with "
                                         r"train_samples >= steps \* global_batch_size"):
        next(batches)
    assert "attention_mask" not in next(micro_batches(train, 4, 0, 1))
