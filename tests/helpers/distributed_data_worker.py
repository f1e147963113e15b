"""Run by tests/test_distributed_data.py under `torchrun --nproc_per_node 2 -m helpers.distributed_data_worker` (gloo,
CPU; helpers.launch).

Each rank prepares the same corpus (counting every image decode in a shared file), builds the Trainer's training
DataLoader and records the sample ids it gets over two epochs; rank 0 writes what all ranks saw to a JSON file.
"""

import json
import os
import sys

import torch.distributed as dist
from transformers import BertConfig, Trainer, TrainingArguments, ViTConfig

import mm_fusion.data.preprocessing as preprocessing
import mm_fusion.image_processing_mm_fusion as image_processing
from mm_fusion import MMFusionConfig, MMFusionForImageTextClassification
from mm_fusion.data import ImageTextCollator, load_pairs, prepare_dataset
from mm_fusion.tokenizer_training import train_tokenizer


_load_image = image_processing.load_image


def counting_load_image(*args, **kwargs):
    """`load_image` that appends this process's rank to the count file on every call."""
    with open(os.environ["MM_FUSION_DECODE_LOG"], "a") as log:
        log.write(os.environ["RANK"] + "\n")
    return _load_image(*args, **kwargs)


def main(data_dir: str, output: str) -> None:
    image_processing.load_image = counting_load_image  # what the processor's load_pixels calls
    preprocessing.load_image = counting_load_image  # what the cache's image map calls
    rows = [json.loads(line) for line in open(os.path.join(data_dir, "pairs.jsonl"))]
    tokenizer = train_tokenizer([r["text"] for r in rows], vocab_size=100)
    prepared = prepare_dataset(
        load_pairs(os.path.join(data_dir, "pairs.jsonl")),
        tokenizer,
        id_column="id",
        label_column="label",
        image_size=16,
        data_root=data_dir,
    )
    tower = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    config = MMFusionConfig(
        vision_config=ViTConfig(image_size=16, patch_size=4, **tower),
        text_config=BertConfig(vocab_size=100, **tower),
        num_fusion_layers=1,
        num_labels=3,
    )
    args = TrainingArguments(
        output_dir=os.path.join(data_dir, "out"),
        per_device_train_batch_size=4,
        remove_unused_columns=False,
        report_to="none",
        use_cpu=True,
        seed=0,
    )
    trainer = Trainer(
        model=MMFusionForImageTextClassification(config),
        args=args,
        train_dataset=prepared.pairs,
        data_collator=ImageTextCollator(prepared.images, pad_token_id=tokenizer.pad_token_id),
    )
    dataloader = trainer.get_train_dataloader()
    epochs = []
    for epoch in range(2):
        dataloader.set_epoch(epoch)
        epochs.append([batch["sample_ids"] for batch in dataloader])  # the collator checks alignment on every batch
    seen = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "epochs": epochs,
        "pairs_fingerprint": prepared.pairs._fingerprint,
        "quarantine": [q["id"] for q in prepared.quarantine],
        "clean_ids": list(prepared.pairs["id"]),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if dist.get_rank() == 0:
        with open(output, "w") as f:
            json.dump(everyone, f)
    dist.barrier()
    dist.destroy_process_group()  # left to the interpreter's exit, gloo can abort a rank with SIGABRT


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
