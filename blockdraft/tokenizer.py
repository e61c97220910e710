"""Tokenizer: the `tokenizers` library for text <-> ids, jinja2 for the chat template."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value: object) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, tokenizer_json: str, tokenizer_config: dict) -> None:
        try:
            self._tok = HFTokenizer.from_str(tokenizer_json)
        except Exception as e:  # the tokenizers library raises its own exception types
            raise ValueError(f"tokenizer.json could not be parsed: {e}") from None
        self.bos_token = _token_text(tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(tokenizer_config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(tokenizer_config.get("add_bos_token", False)) and (
            self.bos_token_id is not None
        )
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        template = tokenizer_config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._compiled_template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        tok_file, cfg_file = path / "tokenizer.json", path / "tokenizer_config.json"
        if not tok_file.is_file():
            raise ValueError(f"{path} has no tokenizer.json")
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        if "chat_template" not in cfg and template_file.is_file():
            cfg["chat_template"] = template_file.read_text()
        return cls(tok_file.read_text(), cfg)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: object
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat_template; use generate()")
        if self._compiled_template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled_template = env.from_string(self.chat_template)
        try:
            return self._compiled_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed on these messages: {e}") from None

    def encode_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[int]:
        """Prompt ids of a chat, as `LLM.chat` sends them. With `continue_final_message` (as in
        vLLM) the last message is an assistant's to be continued: the prompt ends with its
        content, without the template's end-of-turn after it."""
        if not continue_final_message:
            text = self.apply_chat_template(messages, add_generation_prompt)
            return self.encode(text, add_special_tokens=False)
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        final = messages[-1] if messages else None
        if not isinstance(final, dict) or final.get("role") != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        text = self.apply_chat_template(messages, add_generation_prompt=False)
        # Templates may strip the content: cut after its last stripped occurrence.
        content = final["content"].strip()
        end = text.rfind(content) if content else -1
        if end < 0:
            raise ValueError("the chat template does not render the final message's content")
        return self.encode(text[: end + len(content)], add_special_tokens=False)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)
