"""The smoke set of the tests, which tests/conftest.py marks `smoke`."""

# The smoke set (`-m smoke`), which .ci/run runs again against the newest transformers 5.x release: what leans most
# on transformers' internals, in this process (the scripts' subprocess tests are left to the full suite on the
# pinned release). Whole files, or the named tests of a file (every parametrisation).
SMOKE = {
    "test_modeling.py": None,  # every head and fusion type, forward / backward / save / load
    "test_saved_model_formats.py": None,  # directories saved by earlier versions load
    "test_processing.py": None,
    "test_collator.py": None,
    "test_lora.py": None,  # peft on our models
    "test_grad_cache.py": None,  # the gradient cache inside Trainer's accumulation loop
    "test_pipelines.py": {  # all but the four that run scripts/predict.py or visualize_attention.py
        "test_processor_gives_the_cached_pixels_for_every_mode",
        "test_image_processor_errors_name_the_input",
        "test_vqa_pipeline_gives_the_training_evaluation_exactly",
        "test_vqa_pipeline_call_forms_and_image_sharing",
        "test_vqa_pipeline_returns_where_the_model_looked",
        "test_vqa_pipeline_takes_dtype_and_device",
        "test_vqa_pipeline_names_the_bad_input",
        "test_a_task_whose_head_the_model_lacks_is_refused_before_any_weight_is_read",
        "test_words_the_tokenizer_never_saw_are_warned_about_and_named",
        "test_pipeline_save_pretrained_keeps_the_processor",
        "test_retrieval_pipeline_recall_equals_the_training_evaluation",
        "test_matching_pipeline_gives_the_matching_heads_probability",
        "test_zero_shot_stock_pipeline_and_the_cached_one_agree",
        "test_pipelines_load_with_remote_code_where_mm_fusion_is_not_importable",
        "test_auto_image_processor_loads_ours",
        "test_shipped_recall_metric_matches_ranks",
        "test_push_to_hub_sends_model_processor_code_pipelines_and_card",
    },
    "test_training.py": {  # the Trainer and each of its units
        "test_vqa_run_saves_a_loadable_model_with_its_card",
        "test_yaml_config_with_flag_overrides",
        "test_pretrain_task_reports_retrieval_recall",
        "test_a_streaming_runs_card_says_what_was_counted",
        "test_classify_task_on_local_files",
        "test_trainer_features_accumulation_checkpointing_bf16_resume",
        "test_gradient_accumulation_matches_the_full_batch",
        "test_tower_learning_rate_scale",
        "test_early_stopping_stops_and_keeps_the_best",
        "test_trainer_overrides_at_most_three_private_trainer_methods_and_train_once",
        "test_model_config_presets_set_defaults_that_flags_and_overrides_win_over",
    },
    "test_batch_ramp.py": {
        "test_a_ramped_run_grows_its_batches_and_scales_its_learning_rate",
        "test_auto_batch_size_probe_runs_as_training_does",
    },
}
