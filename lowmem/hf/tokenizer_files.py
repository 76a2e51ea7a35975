"""The tokenizer as transformers reads it: tokenizer.json, tokenizer_config.json (with the chat template) and
our tokenizer.model beside them (llama.cpp's converter reads that one).

tokenizer.json is our SentencePiece model restated in the `tokenizers` library's terms, setting by setting
(see `_trainer_options` in lowmem.tokenization.sentencepiece_tokenizer), so that loading it needs no conversion
and no sentencepiece:

    SentencePiece (ours)                      tokenizers
    BPE, pieces ranked by id                  BPE; merges ranked by the id of the piece they make
    byte_fallback                             byte_fallback (pieces <0x00>..<0xFF>, ids 5..260)
    identity normalisation, no dummy prefix   no normalizer; Metaspace "▁" that never prepends one
    <pad> <s> </s> <unk>, user symbol <sep>   special added tokens, ids 0..4
    decode: "▁" -> " ", bytes -> UTF-8        Replace("▁", " "), ByteFallback, Fuse

Nothing is added around an encoded text (no post-processor): the layout `[bos] prompt [sep]` comes from the
chat template, as `Tokenizer.encode_pair` makes it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import sentencepiece as spm

from lowmem.tokenization.chat_template import SINGLE_EXCHANGE_ONLY
from lowmem.tokenization.hf_tokenizer import HF_TOKENIZER_FILES, HFTokenizer
from lowmem.tokenization.text_tokenizer import TextTokenizer
from lowmem.tokenization.sentencepiece_tokenizer import NUM_RESERVED_PIECES, SEP_ID, SEP_PIECE, TOKENIZER_FILE
from lowmem.errors import ConfigError

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
SPECIAL_IDS = range(SEP_ID + 1)  # <pad> <s> </s> <unk> <sep>: ids 0..4

# One exchange, as the model was trained: `[bos] prompt [sep]`, then `response [eos]` when the conversation
# holds the answer. The prompt ends with <sep>, so add_generation_prompt has nothing to add.
CHAT_TEMPLATE = (
    SINGLE_EXCHANGE_ONLY
    + "{{- bos_token + messages[0]['content'] + '" + SEP_PIECE + "' -}}\n"
    "{%- if messages | length == 2 -%}{{- messages[1]['content'] + eos_token -}}{%- endif -%}"
)


def backend_tokenizer(model_file: Path) -> Any:
    """A `tokenizers.Tokenizer` that encodes and decodes as the SentencePiece model in `model_file` does."""
    from tokenizers import AddedToken, Tokenizer as BackendTokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    backend = BackendTokenizer(BPE(vocab=vocab, merges=_merges(pieces, vocab), unk_token=SPECIAL_TOKENS["unk_token"],
                                   fuse_unk=True, byte_fallback=True))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    # Matched whole in text and never split by BPE.
    backend.add_special_tokens([AddedToken(pieces[i], special=True, normalized=False) for i in SPECIAL_IDS])
    return backend


def _merges(pieces: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges in the order SentencePiece applies them: by the id of the piece they make (a lower id is a
    higher score), and for one piece its splits by the ids of their parts. Special and byte pieces take no part."""
    def mergeable(piece: str) -> bool:
        return vocab.get(piece, -1) >= NUM_RESERVED_PIECES

    merges = []
    for piece in pieces[NUM_RESERVED_PIECES:]:
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        splits = [(left, right) for left, right in splits if mergeable(left) and mergeable(right)]
        merges += sorted(splits, key=lambda split: (vocab[split[0]], vocab[split[1]]))
    return merges


def save_tokenizer(folder: Path, model_file: Path, max_seq_len: int) -> None:
    """Write tokenizer.json, tokenizer_config.json (chat template included) and tokenizer.model into `folder`."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend_tokenizer(model_file), **SPECIAL_TOKENS, additional_special_tokens=[SEP_PIECE],
        chat_template=CHAT_TEMPLATE, model_max_length=max_seq_len, clean_up_tokenization_spaces=False,
        padding_side="left",  # batches of prompts for generate(): the answers continue every row's last token
    )
    tokenizer.save_pretrained(folder)
    _readable_by_transformers_4(folder)
    (folder / TOKENIZER_FILE).write_bytes(model_file.read_bytes())


def _readable_by_transformers_4(folder: Path) -> None:
    """Restate in tokenizer_config.json what transformers 5 writes in forms 4.x cannot read (5 reads these too).

    - tokenizer_class: 5 writes "TokenizersBackend", which 4.x lacks; "PreTrainedTokenizerFast" is the same
      class in 5 and, in 4.x, the class that loads tokenizer.json as it is.
    - extra special tokens: 5 writes a list under "extra_special_tokens", where 4.x expects a dict (and stops on
      a list); "additional_special_tokens" is the name both read.
    - chat template: 5 writes chat_template.jinja, which 4.x reads from 4.47 on; the "chat_template" key is read
      by every version.
    """
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = config.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        config["additional_special_tokens"] = extra
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        config["chat_template"] = template_file.read_text(encoding="utf-8")
        template_file.unlink()
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def copy_model_tokenizer(folder: Path, tokenizer_dir: Path, tokenizer: TextTokenizer) -> None:
    """Copy a transformers model's tokenizer (a run started from one trains with it) into the export `folder`: its
    files as they came, the chat template the run used written into tokenizer_config.json when the model had none
    (lowmem's plain layout), so that transformers lays a prompt out as training did. generation_config.json is the
    export's own."""
    assert isinstance(tokenizer, HFTokenizer)  # lowmem's own tokenizer is restated by save_tokenizer instead
    for name in HF_TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file() and name != "generation_config.json":
            shutil.copyfile(tokenizer_dir / name, folder / name)
    if not tokenizer.template_from_source:
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        config["chat_template"] = tokenizer.chat_template
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# Texts a copied transformers tokenizer must encode alike in lowmem and in transformers (beside a prompt).
CHECK_TEXTS = ("春风明月江南归去", "Write a poem of the moon.", "mixed 中文 and English 123", "  two  spaces  ",
               "tabs\tand\nnew lines", "emoji 😀 and rare 龘 characters", "full-width ，。！？")


def check_tokenizer(folder: Path, tokenizer: TextTokenizer, model_file: Path | None) -> None:
    """Load the tokenizer written in `folder` with transformers and check that it gives our ids.

    Checked: for lowmem's tokenizer (`model_file`, its SentencePiece model) every piece of the vocabulary as a text
    of its own (special ones left out: see the README for how the two differ on those), else a few texts of every
    kind; a sentence, and that sentence through the chat template. A difference means that the installed
    transformers reads the files otherwise than the version the export was tested with (5.23).
    """
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = "请写一首词，两行。Write 2 lines:\tplease!"
    texts = [*_vocabulary_pieces(model_file), prompt] if model_file is not None else [*CHECK_TEXTS, prompt]
    templated = hf.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       return_dict=False)  # the ids as a list (5.x returns a dict by default)
    same_texts = hf(texts, add_special_tokens=False)["input_ids"] == tokenizer.encode_batch(texts)
    if not same_texts or list(templated) != tokenizer.encode_pair(prompt, None)[0]:
        where = "on the vocabulary's pieces" if not same_texts else "through the chat template"
        raise ConfigError(
            f"The exported tokenizer, loaded by transformers {transformers.__version__}, encodes differently from "
            f"lowmem's {where}: the export is not written. The export was tested with transformers 5.23; install "
            "that version (pip install \"transformers==5.23.0\") and run the export again.")


def _vocabulary_pieces(model_file: Path) -> list[str]:
    """Every piece of a lowmem SentencePiece model that holds no special piece, as a text of its own."""
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    specials = [sp.id_to_piece(i) for i in SPECIAL_IDS]
    pieces = [sp.id_to_piece(i) for i in range(NUM_RESERVED_PIECES, sp.get_piece_size())]
    return [piece for piece in pieces if not any(special in piece for special in specials)]
