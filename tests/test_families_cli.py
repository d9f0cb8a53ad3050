"""Every stage through the command line with a RoBERTa-family teacher (byte-level BPE tokenizer
trained here) and an ELECTRA-family teacher (narrower embeddings; the packaged WordPiece
tokenizer), random weights of small configs: fine-tuning, general distillation, TinyBERT's two
task stages, KD and PKD (XLM-R's SentencePiece path: tests/test_tokenizers_families.py),
each exported to the family's own HF classes; the last export re-scored by transformers'
PyTorch class on text its exported tokenizer encodes. A family's stages run in one process
(helpers/cli_stages.py)."""
import json

import numpy as np
import pytest

from helpers import cli_stages
STUDENT = ["--config.student.init=random", "--config.student.num_hidden_layers=1",
           "--config.student.hidden_size=16", "--config.student.intermediate_size=32",
           "--config.student.num_attention_heads=4"]
SYNTH = ["--config.data.kind=synthetic", "--config.data.synthetic_train=64",
         "--config.data.synthetic_eval=16", "--config.data.max_len=24", "--config.data.buckets=(24,)"]
SHORT = ["--config.train.num_steps=4", "--config.train.batch_size=8", "--config.train.log_every=2",
         "--config.train.checkpoint_every=4"]


def _teacher(family, out, tokenizer_dir, vocab):
    from jax_tinybert.model.config import BertConfig
    from jax_tinybert.model.export import export_hf
    from jax_tinybert.model.modeling import BertModel, random_params

    extra = (dict(pad_token_id=1, type_vocab_size=1, max_position_embeddings=66,
                  layer_norm_eps=1e-5) if family == "roberta" else dict(embedding_size=16))
    cfg = BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, model_type=family,
                     **{"max_position_embeddings": 64, **extra})
    export_hf(cfg, random_params(BertModel(cfg), 0), str(out), tokenizer_dir=tokenizer_dir)
    return str(out)


@pytest.mark.parametrize("family", ["roberta", "electra"])
def test_every_stage_with_a_teacher_of_another_family(family, tmp_path, bpe_tokenizer_dir,
                                                      teacher_dir):
    import transformers

    from jax_tinybert.model.hf import load_pretrained
    from jax_tinybert.model.modeling import BertForSequenceClassification

    tok_dir = bpe_tokenizer_dir if family == "roberta" else teacher_dir
    vocab = len(transformers.AutoTokenizer.from_pretrained(tok_dir))
    teacher = _teacher(family, tmp_path / "teacher0", tok_dir, vocab)
    cls_name = {"roberta": "RobertaForSequenceClassification",
                "electra": "ElectraForSequenceClassification"}[family]
    cache = f"--config.data.cache_dir={tmp_path / 'cache'}"
    wd = {s: tmp_path / s for s in ("teacher", "general", "inter", "pred", "kd", "pkd")}
    ft = str(wd["teacher"] / "export")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"The film number {i} was good and the actors were fine."
                                for i in range(200)) + "\n")
    stages = {   # in order: the prediction stage starts from the intermediate one's export
        "teacher": ["--config=configs/finetune_teacher.py:sst2", f"--config.teacher.path={teacher}",
                    *SYNTH],
        "general": ["--config=configs/general_distill.py:tiny", f"--config.teacher.path={teacher}",
                    f"--config.data.corpus={corpus}", "--config.data.seq_len=24", *STUDENT],
        "inter": ["--config=configs/task_distill.py:sst2_intermediate",
                  f"--config.teacher.path={ft}", *SYNTH, *STUDENT],
        "pred": ["--config=configs/task_distill.py:sst2_pred", f"--config.teacher.path={ft}",
                 "--config.student.init=pretrained",
                 f"--config.student.path={wd['inter'] / 'export'}", *SYNTH],
        "kd": ["--config=configs/task_distill.py:sst2_pred", "--config.stage=kd",
               "--config.objective.name=kd", f"--config.teacher.path={ft}", *SYNTH, *STUDENT],
        "pkd": ["--config=configs/pkd.py:sst2", f"--config.teacher.path={ft}", *SYNTH, *STUDENT,
                "--config.student.num_hidden_layers=2", "--config.objective.projection=shared"],
    }
    cli_stages.run([[*stages[s], f"--workdir={wd[s]}", cache, *SHORT] for s in stages])
    for s in stages:
        cfg = json.loads((wd[s] / "export" / "config.json").read_text())
        assert cfg["model_type"] == family, (s, cfg)
        if s != "general":    # general distillation exports the encoder alone
            assert cfg["architectures"] == [cls_name], (s, cfg)

    out = str(wd["pred"] / "export")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    enc = tok(["a gripping, funny film", "dull and far too long, it was not fine"],
              padding=True, return_tensors="np")
    ids, mask = enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)
    config, params = load_pretrained(out)
    ours = np.asarray(BertForSequenceClassification(config).apply({"params": params}, ids, mask,
                                                                  np.zeros_like(ids)).logits)
    import torch
    model = getattr(transformers, cls_name).from_pretrained(out).eval()
    with torch.no_grad():
        ref = model(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                    token_type_ids=torch.zeros(ids.shape, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-5)
