"""Model config the run sets (RoPE theta, positions) reaches both models; stop tokens from the chat template."""

import pytest
from transformers import AutoConfig

from trapo.config import Config, ConfigError
from trapo.data import stop_token_ids
from trapo.engine.policy import model_overrides, same_model


def test_rope_override_is_the_whole_rope_parameters_with_the_new_theta():
    cfg = Config()
    cfg.model.rope_theta = 40000
    cfg.model.max_position_embeddings = 16384
    hf = AutoConfig.for_model("qwen2", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    assert hf.rope_parameters["rope_theta"] == 10000.0  # transformers 5.19 reads theta from here only
    overrides = model_overrides(cfg.model, hf)
    assert overrides == {
        "rope_parameters": {**hf.rope_parameters, "rope_theta": 40000.0},
        "max_position_embeddings": 16384,
    }
    assert model_overrides(Config().model, hf) == {}  # nothing set: the checkpoint's own values


def test_same_model_names_each_key_that_differs():
    policy = {"rope_theta": 39999.98, "max_position_embeddings": 2048, "vocab_size": 320, "dtype": "float32"}
    assert same_model(policy, {**policy, "rope_theta": 40000.0}).startswith("policy and engine agree: rope_theta 40000")
    bf16 = {**policy, "dtype": "bfloat16", "rope_theta": 9960.0}  # inv_freq rounded to bf16: theta within 1%
    assert same_model(bf16, {**bf16, "rope_theta": 10000.0}).startswith("policy and engine agree")
    with pytest.raises(ConfigError, match="rope_theta: policy 9960.0, engine 40000.0"):
        same_model(bf16, {**bf16, "rope_theta": 40000.0})
    with pytest.raises(ConfigError) as err:
        same_model(policy, {**policy, "rope_theta": 10000.0, "dtype": "bfloat16"})
    assert "rope_theta: policy 39999.98, engine 10000.0" in str(err.value)
    assert "dtype: policy float32, engine bfloat16" in str(err.value)
    assert "vocab_size" not in str(err.value)


def chat_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["q", "a", "user", "assistant", "\u2063answer\u2063", "\n"]
    vocab = {w: i for i, w in enumerate(["<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def test_stop_tokens_include_the_chat_templates_end_of_turn():
    tok = chat_tokenizer()
    eos, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert im_end != eos  # Qwen's case: the end of a turn is not the tokenizer's EOS
    assert stop_token_ids(tok) == [eos, im_end]
    assert stop_token_ids(tok, generation_eos=[eos, 3]) == [eos, 3, im_end]  # unique, in order
    tok.chat_template = None  # a plain tokenizer: EOS (and the generation config's) only
    assert stop_token_ids(tok, generation_eos=eos) == [eos]
