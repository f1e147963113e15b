"""Train a small WordPiece tokenizer from a corpus, for text towers trained from scratch."""

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

    Example:

    ```python
    >>> from mm_fusion import train_tokenizer
    >>> tok = train_tokenizer(["what shape is in the image?", "is there a blue circle?"], vocab_size=200)
    >>> tok("is there a circle?").input_ids[0] == tok.cls_token_id
    True
    ```
    """
    special = list(SPECIAL_TOKENS.values())
    tokenizer = Tokenizer(models.WordPiece(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special)
    texts = (t for t in texts if isinstance(t, str))
    tokenizer.train_from_iterator(texts, trainer=trainer)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=model_max_length, **SPECIAL_TOKENS)
