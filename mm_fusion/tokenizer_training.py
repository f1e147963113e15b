"""Train a small WordPiece tokenizer from a corpus, for text towers trained from scratch."""

from collections import Counter
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast


SPECIAL_TOKENS = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "mask_token": "[MASK]",
}


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8000,
    min_frequency: int = 1,
    lowercase: bool = True,
    model_max_length: int = 512,
    show_progress: bool = True,
) -> PreTrainedTokenizerFast:
    """
    Train a BERT-style WordPiece tokenizer (`[CLS] text [SEP]`, `[PAD]` = id 0) on `texts` with the `tokenizers`
    library and wrap it as a transformers tokenizer that saves and loads with `AutoTokenizer`.

    Args:
        texts (`Iterable[str]`):
            The training corpus, e.g. the questions of a VQA training split.
        vocab_size (`int`, *optional*, defaults to 8000):
            Upper bound on the vocabulary; a small corpus yields fewer tokens.
        min_frequency (`int`, *optional*, defaults to 1):
            Merges seen fewer times than this are not learned.
        lowercase (`bool`, *optional*, defaults to `True`):
            Lower-case and strip accents before tokenizing.
        model_max_length (`int`, *optional*, defaults to 512):
            Longest sequence the tokenizer will produce with `truncation=True`; match the text tower's
            `max_position_embeddings`.
        show_progress (`bool`, *optional*, defaults to `True`):
            Draw the `tokenizers` trainer's progress bars when sub-word merges are learned (on a terminal only: the
            bars hide themselves when stderr is a file).

    Example:

    ```python
    >>> from mm_fusion import train_tokenizer
    >>> tok = train_tokenizer(["what shape is in the image?", "is there a blue circle?"], vocab_size=200)
    >>> tok("is there a circle?").input_ids[0] == tok.cls_token_id
    True
    ```
    """
    special = list(SPECIAL_TOKENS.values())
    normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    texts = [t for t in texts if isinstance(t, str)]
    vocab = _whole_word_vocab(texts, normalizer, pre_tokenizer, special, vocab_size, min_frequency)
    if vocab is not None:
        tokenizer = Tokenizer(models.WordPiece(vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    else:
        # Sub-word merges are needed. The trainer breaks ties between equally frequent merges differently from run to
        # run, so save the tokenizer with the model rather than retraining it.
        tokenizer = Tokenizer(models.WordPiece(unk_token=SPECIAL_TOKENS["unk_token"]))
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special, show_progress=show_progress
        )
        tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre_tokenizer
        tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.normalizer, tokenizer.pre_tokenizer = normalizer, pre_tokenizer
    tokenizer.decoder = decoders.WordPiece()
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_max_length, **SPECIAL_TOKENS)


def _whole_word_vocab(texts, normalizer, pre_tokenizer, special, vocab_size, min_frequency) -> dict[str, int] | None:
    """
    When every distinct word of the corpus (plus the characters, for unseen words) fits in `vocab_size`, a
    deterministic vocabulary of whole words, ordered by frequency then alphabetically; otherwise None.
    """
    counts = Counter()
    for text in texts:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    words = sorted((w for w, c in counts.items() if c >= min_frequency), key=lambda w: (-counts[w], w))
    chars = sorted({ch for word in words for ch in word})
    pieces = [*chars, *(f"##{ch}" for ch in chars)]
    tokens = list(dict.fromkeys([*special, *pieces, *words]))
    return {token: i for i, token in enumerate(tokens)} if len(tokens) <= vocab_size else None
