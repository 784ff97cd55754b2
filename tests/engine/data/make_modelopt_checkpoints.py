"""Write the ModelOpt fixtures of tests/engine/test_modelopt_export.py (not a test).

Needs nvidia-modelopt (0.47.0 recorded) and transformers, which pdmesh does not depend on;
run it in a throwaway venv (see bench/nvfp4_crosscheck.py), from the repository root:

    /tmp/tao/bin/python tests/engine/data/make_modelopt_checkpoints.py tests/engine/data

It writes three Hugging Face directories for a small random Llama (vocab 256, 2 layers,
hidden 64, 4 heads, 2 KV heads, MLP 128):
- ``modelopt_tiny_bf16``: the model itself, bf16 safetensors.
- ``modelopt_tiny_w4a16``: ModelOpt's NVFP4 weight-only export (quant_algo W4A16_NVFP4).
- ``modelopt_tiny_w4a4``: ModelOpt's NVFP4 export with input quantizers (quant_algo NVFP4,
  an ``input_scale`` per linear). ModelOpt's NVFP4 calibration forward needs CUDA, so the
  input quantizers' amax is set to 4.0 by hand; weights are calibrated from the weights.
  It also gets a 256-token tokenizer (trained here), so a mesh can serve it as it stands;
  the W4A16 one has none, which `pdmesh up` must refuse (tests/test_cli.py).
"""

import copy
import sys
from pathlib import Path

import modelopt.torch.quantization as mtq
import torch
from modelopt.torch.export import export_hf_checkpoint
from transformers import LlamaConfig, LlamaForCausalLM


def tokenizer(vocab: int):
    """A byte-pair tokenizer of exactly `vocab` tokens (<unk>, <s>, </s> first, so bos 1 and
    eos 2 as in the config) with a minimal chat template: what a served model directory
    carries, here small enough to match the 256-token model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    text = ("the quick brown fox jumps over the lazy dog. " * 3 + "hello world! how are you "
            "today? what is the capital of france? paris. 0123456789 , ; : ' \" ( ) - ") * 20
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz"))
    tok.train_from_iterator([text], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    assert len(fast) <= vocab, len(fast)
    return fast


def main(out: Path) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(out / "modelopt_tiny_bf16")

    for name, inputs in (("modelopt_tiny_w4a16", False), ("modelopt_tiny_w4a4", True)):
        m = LlamaForCausalLM.from_pretrained(out / "modelopt_tiny_bf16", dtype=torch.bfloat16)
        qcfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
        if not inputs:
            qcfg["quant_cfg"].append({"quantizer_name": "*input_quantizer", "enable": False})
        m = mtq.quantize(m.eval(), qcfg, forward_loop=None)
        if inputs:
            for module in m.modules():
                q = getattr(module, "input_quantizer", None)
                if q is not None and q.is_enabled:
                    q.amax = torch.tensor(4.0)
        export_hf_checkpoint(m, dtype=torch.bfloat16, export_dir=out / name)
        print(f"wrote {out / name}")
    tokenizer(cfg.vocab_size).save_pretrained(out / "modelopt_tiny_w4a4")  # served in a mesh


if __name__ == "__main__":
    main(Path(sys.argv[1]))
