"""Imported for its effect: transformers' AutoModelForCausalLM builds and loads Mistral 4.
transformers 5.24 maps mistral4 to Mistral4ForCausalLM for pretraining and image-text-to-text,
not as a causal LM, which the tests build and load it as."""

import transformers

transformers.AutoModelForCausalLM.register(
    transformers.Mistral4Config, transformers.Mistral4ForCausalLM, exist_ok=True
)
