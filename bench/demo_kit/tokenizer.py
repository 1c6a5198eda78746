"""The small byte-level BPE tokenizer with a ChatML chat template that the demo and test checkpoints ship.

Layout of the ids (vocab_size V, all of them real ids of the tokenizer, so len(tokenizer) == V):
    [0, V - 7 - P)       byte-level BPE: the 256 byte tokens, then merges learned from corpus.corpus()
    next 3 (special)     <|endoftext|>, <|im_start|>, <|im_end|>
    next 4 (not special) <tool_call>, </tool_call>, <tool_response>, </tool_response>
    last P (special)     <|reserved_special_N|>, only when the corpus cannot fill V with merges (P = 0 up to ~4150)
No BOS is ever added (as Qwen): encode(text, add_special_tokens=True) == encode(text, add_special_tokens=False).
EOS: <|im_end|> (tokenizer_config) and, in generation_config.json, both <|im_end|> and <|endoftext|>.
The tool tags are ordinary added tokens, so decode(skip_special_tokens=True) keeps them (tool-call parsers see them).
"""
from __future__ import annotations

import functools
import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from .corpus import corpus

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TOOL_RESULT_OPEN = "<tool_response>"  # the chat template wraps every tool result in it
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(TOOL_TOKENS)

# ChatML (Qwen/Hermes style). Tools go into the system turn as one JSON object per line inside <tools></tools>;
# an assistant turn's tool calls are rendered exactly as the model is asked to emit them; each tool result is its
# own user turn wrapped in <tool_response></tool_response>, so extending a conversation never rewrites its past.
# Content is a string, None, or a list of {"type": "text", "text": ...} parts (concatenated without separator).
CHAT_TEMPLATE = r"""
{%- macro text_of(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}
            {%- elif part['type'] == 'text' -%}{{- part['text'] -}}
            {%- else -%}{{- raise_exception('only text content parts are supported, got ' ~ part['type']) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set first_is_system = messages | length > 0 and messages[0]['role'] == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_is_system -%}{{- text_of(messages[0]['content']) + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou may call one or more of the functions described, as JSON, inside <tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, answer with its name and arguments as a JSON object inside '
        + '<tool_call></tool_call> tags:\n<tool_call>{"name": <function-name>, "arguments": <args-json-object>}'
        + '</tool_call><|im_end|>\n' -}}
{%- elif first_is_system -%}
    {{- '<|im_start|>system\n' + text_of(messages[0]['content']) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.first and first_is_system -%}
    {%- elif message['role'] in ('user', 'system') -%}
        {{- '<|im_start|>' + message['role'] + '\n' + text_of(message['content']) + '<|im_end|>\n' -}}
    {%- elif message['role'] == 'assistant' -%}
        {{- '<|im_start|>assistant\n' + text_of(message['content']) -}}
        {%- for call in message.get('tool_calls') or [] -%}
            {%- set fn = call['function'] if call['function'] is defined else call -%}
            {%- if loop.first and text_of(message['content']) -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>{"name": ' + (fn['name'] | tojson) + ', "arguments": ' -}}
            {%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}
            {{- '}</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message['role'] == 'tool' -%}
        {{- '<|im_start|>user\n<tool_response>\n' + text_of(message['content']) + '\n</tool_response><|im_end|>\n' -}}
    {%- else -%}
        {{- raise_exception('unknown message role: ' ~ message['role']) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()


def build_tokenizer(out_dir: str, vocab_size: int = 2048) -> None:
    """Write tokenizer.json and tokenizer_config.json (a transformers fast tokenizer) to out_dir.

    Deterministic: the same vocab_size always gives byte-identical files.
    """
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json(vocab_size))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(_tokenizer_config(), f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")


def write_generation_config(out_dir: str, vocab_size: int) -> None:
    """generation_config.json with eos_token_id = [<|im_end|>, <|endoftext|>] (ids of this tokenizer layout);
    without eos ids when vocab_size is too small to hold the tokenizer."""
    body: dict = {"_from_model_config": False, "do_sample": False}
    if vocab_size >= MIN_VOCAB_SIZE:
        ids = special_token_ids(vocab_size)
        body.update(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(body, f, indent=2, sort_keys=True)
        f.write("\n")


@functools.lru_cache(maxsize=8)
def special_token_ids(vocab_size: int = 2048) -> dict[str, int]:
    """Ids of the special and tool tokens for a tokenizer built with this vocab_size (do not mutate)."""
    tok = Tokenizer.from_str(tokenizer_json(vocab_size))
    return {name: tok.token_to_id(name) for name in SPECIAL_TOKENS + TOOL_TOKENS}


@functools.lru_cache(maxsize=8)
def tokenizer_json(vocab_size: int) -> str:
    """The tokenizer.json text for vocab_size ids (trained once per process and size; ~0.1 s)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + 7 added tokens), got {vocab_size}")
    num_added = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # min_frequency=2 keeps once-seen byte pairs (the emoji of corpus._ONCE) unmerged.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus().splitlines(keepends=True), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    num_reserved = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    reserved = [f"<|reserved_special_{i}|>" for i in range(num_reserved)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"built {tok.get_vocab_size(with_added_tokens=True)} ids instead of {vocab_size}")
    return tok.to_str(pretty=True)


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }
