"""Data for pre-training: corpora, tokenizers, BERT's MLM/NSP batches, GPT's token blocks.

- `corpus`: the documentation CPython ships (`pydoc_data.topics`) or a user's text file, as
  documents (lists of sentences) or raw texts; a seeded train/validation split.
- `tokenizers`: the MiniLM WordPiece vocabulary, or WordPiece / byte-level BPE trained here.
- `nsp`: [CLS] A [SEP] B [SEP] pairs, 50% IsNext, 50% NotNext from another document.
- `mlm`: 15% of tokens selected, then 80% [MASK], 10% random, 10% unchanged, per batch.
- `lm`: the token stream cut into blocks for causal language modelling.
- `digits`: scikit-learn's 1,797 8x8 handwritten digits as images, split by class, shifted.
- `digit_video`: clips of those digits moving across a larger canvas, labelled with the digit
  and the direction of motion.
- `prompts`: English phrasings of each digit ("a handwritten seven"), their WordPiece tokenizer.
- `gguf_tokenizer`: the byte-level BPE tokenizer and the chat template a GGUF file carries
  (SmolLM2's, for one), with the ids transformers gives and its chat template rendering.

Every dataset is a plain indexable object (len and []), so any sampler can draw from it.
"""

from qkv.data.corpus import (
    documentation_sentences,
    pydoc_documents,
    pydoc_texts,
    split_sentences,
    text_file_documents,
    text_file_texts,
    train_validation_split,
)
from qkv.data.digit_video import DigitClips, DigitVideoSplits, digit_clips, digit_video_splits
from qkv.data.digits import (
    DigitSplits,
    LabelledImages,
    digit_splits,
    load_digits,
    shift_images,
    split_digits,
)
from qkv.data.gguf_tokenizer import (
    GGUF_PRE_TOKENIZERS,
    ChatFormat,
    chat_format_from_metadata,
    gguf_pre_tokenizer,
    render_chat,
    tokenizer_from_gguf,
    tokenizer_from_metadata,
)
from qkv.data.lm import TokenBlocks, causal_lm_blocks, token_stream
from qkv.data.mlm import IGNORE_INDEX, PretrainingCollator, mask_tokens, pad_examples
from qkv.data.nsp import IS_NEXT, NOT_NEXT, NspExample, make_nsp_examples
from qkv.data.prompts import (
    DIGIT_WORDS,
    NULL_PROMPT,
    digit_prompts,
    encode_prompts,
    evaluation_prompt,
    prompt_corpus,
    train_prompt_tokenizer,
)
from qkv.data.tokenizers import (
    BERT_SPECIAL_TOKENS,
    END_OF_TEXT,
    BertSpecialIds,
    bert_special_ids,
    load_tokenizer,
    minilm_wordpiece,
    save_tokenizer,
    train_bpe,
    train_wordpiece,
)

__all__ = [
    "BERT_SPECIAL_TOKENS",
    "DIGIT_WORDS",
    "END_OF_TEXT",
    "GGUF_PRE_TOKENIZERS",
    "IGNORE_INDEX",
    "IS_NEXT",
    "NOT_NEXT",
    "NULL_PROMPT",
    "BertSpecialIds",
    "ChatFormat",
    "DigitClips",
    "DigitVideoSplits",
    "DigitSplits",
    "LabelledImages",
    "NspExample",
    "PretrainingCollator",
    "TokenBlocks",
    "bert_special_ids",
    "causal_lm_blocks",
    "chat_format_from_metadata",
    "digit_clips",
    "digit_prompts",
    "digit_splits",
    "digit_video_splits",
    "documentation_sentences",
    "encode_prompts",
    "evaluation_prompt",
    "gguf_pre_tokenizer",
    "load_digits",
    "load_tokenizer",
    "make_nsp_examples",
    "mask_tokens",
    "minilm_wordpiece",
    "pad_examples",
    "prompt_corpus",
    "pydoc_documents",
    "pydoc_texts",
    "render_chat",
    "save_tokenizer",
    "shift_images",
    "split_digits",
    "split_sentences",
    "text_file_documents",
    "text_file_texts",
    "token_stream",
    "tokenizer_from_gguf",
    "tokenizer_from_metadata",
    "train_bpe",
    "train_prompt_tokenizer",
    "train_validation_split",
    "train_wordpiece",
]
