"""Reading transformers VisualBERT directories: every weight accounted for, outputs unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from model.row_order import MATCHED_INDEX
from model.visualbert import VisualBert, VisualBertForPreTraining, VisualBertForQuestionAnswering
from model.visualbert.convert import read_hf_dir

transformers = pytest.importorskip("transformers")


def test_pretraining_directory_bin_with_tied_decoder(tmp_path, vb):
    cfg = vb.small_config()
    torch.manual_seed(0)
    hf = transformers.VisualBertForPreTraining(vb.hf_config(cfg)).eval()
    hf.config.architectures = ["VisualBertForPreTraining"]
    hf.config.save_pretrained(tmp_path)
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")  # the older layout, decoder written out
    model, report = read_hf_dir(tmp_path)
    assert isinstance(model, VisualBertForPreTraining)
    assert report.missing == [] and report.unexpected == []
    assert sorted(report.tied) == ["cls.predictions.decoder.bias", "cls.predictions.decoder.weight"]
    assert len(report.loaded) + len(report.tied) == len(hf.state_dict())
    inputs = vb.make_inputs(cfg)
    with torch.no_grad():
        ref = hf(**vb.hf_inputs(inputs))
        out = model.eval()(**inputs)
    # uclanlp/visualbert's weights score "matched" at row 1, as xmodal does: the rows stay where they are
    torch.testing.assert_close(out.matched_logits, ref.seq_relationship_logits, atol=1e-5, rtol=1e-5)


def test_a_head_trained_with_uclanlp_labels_keeps_its_meaning(tmp_path, vb):
    """uclanlp/visualbert labels a pair `int(is_correct)` (dataloaders/coco_dataset.py `flag = True` for the
    image's own caption, bert_data_utils.py `int(self.is_next)`): a head trained so must say "matched" at
    xmodal's MATCHED_INDEX after `convert`, and again at transformers' row 1 after `--to-hf`."""
    from model.visualbert.convert import export_hf

    cfg = vb.small_config()
    torch.manual_seed(0)
    hf = transformers.VisualBertForPreTraining(vb.hf_config(cfg)).eval()
    hf.config.architectures = ["VisualBertForPreTraining"]
    inputs = vb.hf_inputs(vb.make_inputs(cfg, batch=4, padded=False))
    is_correct = torch.tensor([True, False, True, False])
    with torch.no_grad():
        pooled = hf.visual_bert(**inputs).pooler_output
    head = hf.cls.seq_relationship
    opt = torch.optim.SGD(head.parameters(), lr=1.0)
    for _ in range(50):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(head(pooled), is_correct.long()).backward()
        opt.step()
    hf.save_pretrained(tmp_path / "hf")
    model, _ = read_hf_dir(tmp_path / "hf")
    ours = vb.make_inputs(cfg, batch=4, padded=False)
    with torch.no_grad():
        matched = model.eval()(**ours).matched_logits.softmax(-1)[:, MATCHED_INDEX]
    assert ((matched > 0.5) == is_correct).all(), matched
    export_hf(model, tmp_path / "back")
    back = transformers.VisualBertForPreTraining.from_pretrained(
        tmp_path / "back", attn_implementation="eager"
    )
    with torch.no_grad():
        again = back.eval()(**inputs).seq_relationship_logits.softmax(-1)[:, 1]
    torch.testing.assert_close(again, matched, atol=1e-5, rtol=1e-5)


def test_question_answering_safetensors_directory(tmp_path, vb):
    cfg = vb.small_config()
    hf_cfg = vb.hf_config(cfg)
    hf_cfg.num_labels = 7
    hf = transformers.VisualBertForQuestionAnswering(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    model, report = read_hf_dir(tmp_path)
    assert isinstance(model, VisualBertForQuestionAnswering) and model.num_answers == 7
    assert report.missing == [] and report.unexpected == [] and report.tied == []
    inputs = vb.make_inputs(cfg)
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(**inputs).logits, hf(**vb.hf_inputs(inputs)).logits, atol=1e-5, rtol=1e-5
        )


def test_other_heads_load_the_backbone_and_report_theirs(tmp_path, vb):
    cfg = vb.small_config()
    hf = transformers.VisualBertForMultipleChoice(vb.hf_config(cfg))
    hf.save_pretrained(tmp_path)
    model, report = read_hf_dir(tmp_path)
    assert isinstance(model, VisualBert)
    assert sorted(report.unexpected) == ["cls.bias", "cls.weight"] and report.missing == []


def test_backbone_directory_into_a_head_class_reports_the_head_missing(tmp_path, vb):
    from model.foreign import read_weights
    from model.visualbert.convert import load_hf_state

    cfg = vb.small_config()
    transformers.VisualBertModel(vb.hf_config(cfg)).save_pretrained(tmp_path)
    model = VisualBertForQuestionAnswering(cfg, num_answers=3)
    report = load_hf_state(model, read_weights(tmp_path / "model.safetensors"), str(tmp_path))
    assert report.missing == ["cls.bias", "cls.weight"] and report.unexpected == []


def test_unsupported_settings_are_refused(tmp_path, vb):
    cfg = vb.small_config()
    transformers.VisualBertModel(vb.hf_config(cfg)).save_pretrained(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**meta, "bypass_transformer": True}))
    with pytest.raises(ValueError, match="bypass_transformer"):
        read_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**meta, "model_type": "bert"}))
    with pytest.raises(ValueError, match="not a transformers VisualBERT"):
        read_hf_dir(tmp_path)


def test_convert_writes_an_xmodal_directory_and_from_pretrained_reads_transformers_too(tmp_path, vb):
    from model import read_config
    from model.visualbert import convert_visualbert

    cfg = vb.small_config()
    hf_cfg = vb.hf_config(cfg)
    hf_cfg.num_labels = 4
    hf = transformers.VisualBertForQuestionAnswering(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    inputs = vb.make_inputs(cfg)
    with torch.no_grad():
        expected = hf(**vb.hf_inputs(inputs)).logits
    converted = convert_visualbert(tmp_path / "hf", tmp_path / "ours")
    assert read_config(converted)[:1] == ("VisualBertForQuestionAnswering",)
    for directory in (converted, tmp_path / "hf"):
        model = VisualBertForQuestionAnswering.from_pretrained(directory).eval()
        assert model.num_answers == 4
        with torch.no_grad():
            torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-5, rtol=1e-5)
    backbone = VisualBert.from_pretrained(tmp_path / "hf")  # the head's weights are left out
    assert set(backbone.state_dict()) == {k.removeprefix("visual_bert.") for k in hf.visual_bert.state_dict()}


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ("VisualBert", "VisualBertModel"),
        ("VisualBertForPreTraining", "VisualBertForPreTraining"),
        ("VisualBertForQuestionAnswering", "VisualBertForQuestionAnswering"),
        ("VisualBertForNLVR2", "VisualBertForVisualReasoning"),
    ],
)
def test_export_is_a_directory_transformers_loads_whole(tmp_path, vb, ours, theirs):
    """Every weight lands in transformers' model (none missing, none unused) and, where the inputs are the
    same, the outputs are ours."""
    import model.visualbert as family
    from model.visualbert.convert import export_hf

    cfg = vb.small_config()
    torch.manual_seed(0)
    cls = getattr(family, ours)
    model = (cls(cfg, num_answers=5) if ours == "VisualBertForQuestionAnswering" else cls(cfg)).eval()
    vb.perturb(model)
    export_hf(model, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [theirs]
    hf, info = getattr(transformers, theirs).from_pretrained(
        tmp_path / "hf", output_loading_info=True, attn_implementation="eager"
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    theirs_state = hf.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(theirs_state[name], value, rtol=0, atol=0)
    if ours == "VisualBertForNLVR2":
        return  # its two images travel as one sequence in a layout transformers' class is not given here
    inputs = vb.make_inputs(cfg)
    with torch.no_grad():
        out, ref = model(**inputs), hf.eval()(**vb.hf_inputs(inputs))
    if ours == "VisualBertForQuestionAnswering":
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=1e-5)
    elif ours == "VisualBertForPreTraining":
        torch.testing.assert_close(
            out.matched_logits.softmax(-1)[:, MATCHED_INDEX],
            ref.seq_relationship_logits.softmax(-1)[:, MATCHED_INDEX],
            atol=1e-5,
            rtol=1e-5,
        )
        text = out.lm_logits.shape[1]  # transformers predicts words at the region positions too
        torch.testing.assert_close(out.lm_logits, ref.prediction_logits[:, :text], atol=1e-4, rtol=1e-5)
    else:
        torch.testing.assert_close(out.pooled_output, ref.pooler_output, atol=1e-5, rtol=1e-5)


def test_a_uclanlp_release_keeps_its_regions_token_type_wherever_it_runs(tmp_path, vb):
    """uclanlp/visualbert's COCO pre-training and VQA code feed every region visual token type 0
    (TrainVisualBERTObjective fills zeros when the data gives none); transformers feeds 1. A release
    converted from the hub records 0 and runs with it after saving and as a fine-tuning start; the
    reference is transformers' model given the zeros outright."""
    from model import read_config
    from model.visualbert.convert import convert_visualbert
    from pipelines.cli import main

    cfg = vb.small_config()
    torch.manual_seed(0)
    hf = transformers.VisualBertForPreTraining(vb.hf_config(cfg)).eval()
    vb.perturb(hf)
    with torch.no_grad():  # rows as far apart as trained ones, so that taking the wrong one shows
        hf.visual_bert.embeddings.visual_token_type_embeddings.weight[0].normal_(0.0, 1.0)
    hf.config.architectures = ["VisualBertForPreTraining"]
    release = tmp_path / "uclanlp" / "visualbert-vqa-coco-pre"  # as the hub names it
    hf.save_pretrained(release)
    cached = tmp_path / "hub" / "models--uclanlp--visualbert-nlvr2-coco-pre" / "snapshots" / "0abc"
    hf.save_pretrained(cached)  # as huggingface_hub's cache stores it
    native = tmp_path / "mine"
    hf.save_pretrained(native)
    inputs = vb.make_inputs(cfg)
    theirs = vb.hf_inputs(inputs)
    with torch.no_grad():
        zeros = hf(**theirs, visual_token_type_ids=torch.zeros_like(inputs["visual_attention_mask"]))
        ones = hf(**theirs)
    assert (zeros.prediction_logits - ones.prediction_logits)[:, :7].abs().max() > 1e-3  # the type shows

    for src in (release, cached):
        converted = convert_visualbert(src, tmp_path / "ours" / src.name)
        assert read_config(converted)[1]["visual_token_type_id"] == 0
    model = VisualBertForPreTraining.from_pretrained(converted).eval()
    model.save_pretrained(tmp_path / "saved")
    again = VisualBertForPreTraining.from_pretrained(tmp_path / "saved").eval()
    assert again.config.visual_token_type_id == 0
    with torch.no_grad():
        out = again(**inputs)
    torch.testing.assert_close(out.matched_logits, zeros.seq_relationship_logits, atol=1e-5, rtol=1e-5)
    text = inputs["input_ids"].shape[1]  # ours scores the text positions only
    torch.testing.assert_close(out.lm_logits, zeros.prediction_logits[:, :text], atol=1e-5, rtol=1e-5)

    tuned = VisualBertForQuestionAnswering.from_pretrained(converted, num_answers=3).eval()  # finetune --init
    assert tuned.config.visual_token_type_id == 0
    with torch.no_grad():
        states = tuned.visual_bert(**inputs).sequence_output
        reference = hf.visual_bert(
            **theirs, visual_token_type_ids=torch.zeros_like(inputs["visual_attention_mask"])
        ).last_hidden_state
    torch.testing.assert_close(states, reference, atol=1e-5, rtol=1e-5)

    # transformers' own (and xmodal's) keep type 1; the command line says it outright either way
    assert read_config(convert_visualbert(native, tmp_path / "native"))[1]["visual_token_type_id"] == 1
    told = tmp_path / "told"
    assert main(["convert", "visualbert", str(native), str(told), "--visual-token-type", "0"]) == 0
    told = VisualBertForPreTraining.from_pretrained(told).eval()
    with torch.no_grad():
        told_out = told(**inputs)
    torch.testing.assert_close(told_out.matched_logits, zeros.seq_relationship_logits, atol=1e-5, rtol=1e-5)
