"""
transformers' own common model tests (`ModelTesterMixin`, from `tests/test_modeling_common.py` of the source
distribution of the installed transformers version) run against every MMFusion head, for each fusion type and vision
tower kind, and for the one-way fusion direction (`text_to_image`, no image stream: what it changes in the modules
is the same for every fusion type; tests/test_modeling.py runs each direction with each fusion type), with tiny
configs.

The tests are not copied into this repository: they are imported at test time from the unpacked sdist that
`MM_FUSION_TRANSFORMERS_SDIST` points to (`.ci/run` fetches it into its cache with
`pip download --no-binary :all: --no-deps transformers==<installed version>`), or from the default cache location
below. Without it the module is skipped, except under CI (`CI` set), where that is an error.
"""

import copy
import importlib
import importlib.util
import os
import sys
import types
import unittest
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from helpers.models import MMFusionModelTester, expected_output_shapes

from mm_fusion import MMFusionConfig, MMFusionForImageTextClassification, MMFusionForPretraining, MMFusionModel


SDIST_VARIABLE = "MM_FUSION_TRANSFORMERS_SDIST"
CACHE = Path(os.environ.get("MM_FUSION_CI_CACHE") or Path.home() / ".cache" / "mm_fusion-ci")
VERSION = transformers.__version__
DEFAULT_SDIST = CACHE / f"transformers-sdist-{VERSION}" / f"transformers-{VERSION}"
# The name the sdist's `tests` package is imported under: ours is also called `tests`.
PACKAGE = "transformers_sdist_tests"


def _sdist_tests_dir() -> tuple[Path | None, str]:
    """The sdist's `tests/` folder, or None and why it cannot be used."""
    root = Path(os.environ.get(SDIST_VARIABLE) or DEFAULT_SDIST)
    how = f"{SDIST_VARIABLE}={root}" if os.environ.get(SDIST_VARIABLE) else f"the default {root}"
    if not (root / "tests" / "test_modeling_common.py").is_file():
        return None, (
            f"transformers' common model tests not found ({how} has no tests/test_modeling_common.py). Fetch them "
            f"with `pip download --no-binary :all: --no-deps transformers=={VERSION}`, unpack the archive and set "
            f"{SDIST_VARIABLE} to the unpacked folder (`bash .ci/run` does this)."
        )
    pkg_info = root / "PKG-INFO"
    lines = pkg_info.read_text(errors="replace").splitlines() if pkg_info.is_file() else []
    found = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Version:")), None)
    if found != VERSION:
        return None, f"{how} is the sdist of transformers {found}, but {VERSION} is installed."
    return root / "tests", ""


def _import_common_tests(tests_dir: Path) -> types.ModuleType:
    """
    Import the sdist's `tests/test_modeling_common.py` as `transformers_sdist_tests.test_modeling_common`, a package
    whose path is the sdist's `tests/` folder, so that its relative imports resolve there. The sdist leaves out
    `tests/exporters/` and `tests/generation/`; `ModelTesterMixin` only needs a base class from each, so empty ones
    stand in (the torch.export tests of `ExportTesterMixin` are not run; our models cannot generate).
    """
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(tests_dir)]
    sys.modules[PACKAGE] = package
    for subpackage, module_name, mixin in (
        ("exporters", "test_export", "ExportTesterMixin"),
        ("generation", "test_utils", "GenerationTesterMixin"),
    ):
        if (tests_dir / subpackage / f"{module_name}.py").is_file():
            continue
        parent = types.ModuleType(f"{PACKAGE}.{subpackage}")
        parent.__path__ = []
        module = types.ModuleType(f"{PACKAGE}.{subpackage}.{module_name}")
        setattr(module, mixin, type(mixin, (), {"__doc__": "Stand-in: not in the transformers sdist."}))
        sys.modules[parent.__name__], sys.modules[module.__name__] = parent, module
    with warnings.catch_warnings():
        # Its markers (flash_attn_test, torch_compile_test, ...) are registered in transformers' own pytest config.
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        return importlib.import_module(f"{PACKAGE}.test_modeling_common")


# About 2 minutes on 2 cores: deselected by default like the fault tests; `.ci/run` runs `pytest -m conformance`.
pytestmark = pytest.mark.conformance

TESTS_DIR, UNAVAILABLE = _sdist_tests_dir()
if TESTS_DIR is not None and importlib.util.find_spec("parameterized") is None:
    TESTS_DIR, UNAVAILABLE = None, "transformers' common model tests need `parameterized`: pip install -e '.[test]'."
if TESTS_DIR is None:
    if os.environ.get("CI"):
        pytest.fail(f"CI must run transformers' common model tests: {UNAVAILABLE}", pytrace=False)
    pytest.skip(UNAVAILABLE, allow_module_level=True)
common = _import_common_tests(TESTS_DIR)


def skipped_mixin_test(name: str, reason: str):
    """The mixin's own test `name`, reported as skipped with `reason`: for the tests that the mixin runs on every model
    class, with no flag or attribute that leaves them out where they do not apply."""
    return unittest.skip(reason)(getattr(common.ModelTesterMixin, name))


class MMFusionCommonTester:
    """
    The shared tiny configs and inputs of conftest.py (hidden 32, 2 layers, 4 heads, vocab 99, 30 px images, padded
    texts), here in 6 px patches (26 image tokens), with the attributes transformers' `ModelTesterMixin` reads.
    """

    shared = MMFusionModelTester()
    batch_size, seq_length, vocab_size, image_size = (
        shared.batch_size,
        shared.seq_length,
        shared.vocab_size,
        shared.image_size,
    )
    hidden_size = 32
    num_hidden_layers = 2  # of each tower and of the fusion block
    num_attention_heads = 4
    patch_size = 6
    num_channels = 3
    is_training = True

    def __init__(self, parent: unittest.TestCase, fusion_type: str, fusion_direction: str, vision_tower: str = "vit"):
        self.parent = parent
        self.fusion_type = fusion_type
        self.fusion_direction = fusion_direction
        self.vision_tower = vision_tower

    def get_config(self) -> MMFusionConfig:
        extra = {}
        if self.vision_tower.startswith("resnet"):  # a backbone: its feature maps become the image tokens
            vision_config = self.shared.resnet_config()
        else:
            vision_config = self.shared.vision_config(patch_size=self.patch_size)
        if self.vision_tower == "conv_stem":  # a stride-2 convolution + BatchNorm, then a stride-3 one: 6 px patches
            extra["vision_conv_stem"] = [8]
        if self.vision_tower == "resnet_film":  # its stages scaled and shifted by the text
            extra["vision_film"] = True
        if self.vision_tower == "resnet_text_attention":  # its stages' cells read the text by cross-attention
            extra["vision_text_attention"] = True
        return self.shared.config(
            self.fusion_type, fusion_direction=self.fusion_direction, vision_config=vision_config, **extra
        )

    def prepare_config_and_inputs_for_common(self) -> tuple[MMFusionConfig, dict[str, torch.Tensor]]:
        return self.get_config(), self.shared.inputs()


HEADS = (MMFusionForImageTextClassification, MMFusionForPretraining)
# The tensor each class's outputs are judged by: it depends on both towers and, but for "late", on the fusion layers.
MAIN_OUTPUT = {
    MMFusionModel: "pooler_output",
    MMFusionForImageTextClassification: "logits",
    MMFusionForPretraining: "itm_logits",
}


class MMFusionCommonTests(common.ModelTesterMixin):
    """
    The mixin's tests for one fusion type and direction; the subclasses below pick them. Where a test assumes a
    single-sequence model (one `hidden_states` / `attentions` tuple), it is replaced by one that checks the same
    thing on MMFusion's fields for the towers and the fusion streams, as transformers' BridgeTower tests do.
    """

    fusion_type: str
    fusion_direction = "bidirectional"
    # "resnet": a backbone tower; "resnet_film" / "resnet_text_attention": the same conditioned on the text by FiLM /
    # by cross-attention; "conv_stem": a ViT with a convolutional stem
    vision_tower = "vit"
    all_model_classes = (MMFusionModel, *HEADS)
    heads = HEADS  # the classes with a loss
    # The eager-vs-SDPA test feeds `main_input_name` (input_ids) and these.
    additional_model_inputs = ["pixel_values"]
    _is_composite = True  # vision and text sub-configs
    # The initialisation test runs only for models it dates to 2023 or later by a copyright line, which our files do
    # not have; this is its switch for the others.
    test_can_init_all_missing_weights_before_2023 = True

    # The mixin's eager-vs-SDPA test compares `vision_hidden_states` (MMFusionModel, the classifier) and
    # `logits_per_text` (pretraining): tower outputs, the same for every fusion type. It is the slowest of the mixin's
    # tests (fp16 / bf16 on CPU), so it runs in one variant; tests/test_modeling.py::test_eager_attention_matches_sdpa
    # compares every output, the fusion layers' included, for every fusion type and direction.
    runs_tower_only_eager_test = False
    # The mixin's check that `from_pretrained(torch_dtype=...)` loads as `dtype=...` does, for seven dtypes and every
    # class (~10-15 s a variant on 2 cores): a loading argument, which neither the fusion type and direction nor the
    # tower's modules touch (the model keeps no module in another dtype). It runs for a ViT tower and for a ResNet,
    # whose BatchNorm buffers load beside the weights, in the variants marked here.
    runs_dtype_loading_test = False

    def setUp(self):
        eager_test = self._testMethodName.startswith("test_eager_matches_sdpa_inference")
        if eager_test and not self.runs_tower_only_eager_test:
            self.skipTest(
                "compares tower outputs only, the same for every fusion type: run in MMFusionHierarchicalTest "
                "(test_modeling.py::test_eager_attention_matches_sdpa covers the fusion layers)"
            )
        if self._testMethodName == "test_bc_torch_dtype" and not self.runs_dtype_loading_test:
            self.skipTest("a loading argument, the same for every fusion type and tower: run for a ViT and a ResNet")
        self.model_tester = MMFusionCommonTester(self, self.fusion_type, self.fusion_direction, self.vision_tower)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        # The mixin adds labels for transformers' own task classes, found by name; these are ours.
        inputs_dict = super()._prepare_for_class(inputs_dict, model_class, return_labels=return_labels)
        if return_labels and model_class is MMFusionForImageTextClassification:
            inputs_dict["labels"] = torch.zeros(self.model_tester.batch_size, dtype=torch.long)
        elif return_labels and model_class is MMFusionForPretraining:
            inputs_dict["return_loss"] = True
        return inputs_dict

    # The training tests leave base models (no loss) out by their names in transformers' own MODEL_MAPPING_NAMES;
    # MMFusionModel, registered through AutoModel.register, is not in it, so they run on the heads only.
    def test_training(self):
        self.all_model_classes = self.heads
        super().test_training()

    def check_training_gradient_checkpointing(self, gradient_checkpointing_kwargs=None):
        self.all_model_classes = self.heads
        super().check_training_gradient_checkpointing(gradient_checkpointing_kwargs)

    def _expected_shapes(self) -> dict[str, tuple[int, tuple[int, ...]] | None]:
        """For each hidden-state / attention field: (number of entries, shape of each), or None when not returned."""
        t = self.model_tester
        B, T, P, D, H = t.batch_size, t.seq_length, (t.image_size // t.patch_size) ** 2 + 1, t.hidden_size, 4
        L = t.num_hidden_layers  # both towers and the fusion block have this many layers
        if not self.vision_tower.startswith("resnet"):
            return expected_output_shapes(B, T, P, D, H, L, self.fusion_type, self.fusion_direction)
        # ResNet at 30 px: stem 8x8 (8 channels), stage1 8x8 (8), stage2 4x4 (16). Hierarchical fusion reads stages
        # 1 and 2 on the finer 8x8 grid, the others stage 2 (4x4), as tokens of the fusion width.
        P = 64 if self.fusion_type == "hierarchical" else 16
        shapes = expected_output_shapes(B, T, P, D, H, L, self.fusion_type, self.fusion_direction)
        shapes["vision_hidden_states"] = [(B, 8, 8, 8), (B, 8, 8, 8), (B, 16, 4, 4)]  # the backbone's own maps
        shapes["vision_attentions"] = None  # a convolutional tower has none
        return shapes

    def _check_fields(self, outputs, kind: str, requested: bool):
        """The `kind` ("hidden_states" / "attentions") fields of `outputs` have the expected count and shapes."""
        for name, expected in self._expected_shapes().items():
            if not name.endswith(kind):
                continue
            value = getattr(outputs, name)
            if expected is None or not requested:
                self.assertIsNone(value, name)
                continue
            self.assertIsInstance(value, tuple, name)
            if isinstance(expected, list):  # one shape per entry
                self.assertEqual([tuple(tensor.shape) for tensor in value], expected, name)
                continue
            count, shape = expected
            self.assertEqual(len(value), count, name)
            for tensor in value:
                self.assertEqual(tuple(tensor.shape), shape, name)

    def test_hidden_states_output(self):
        # Replaces the mixin's: MMFusion returns the towers' and the fusion streams' hidden states in named fields.
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            with self.subTest(model_class.__name__):
                model = model_class(copy.deepcopy(config)).eval()
                inputs = self._prepare_for_class(inputs_dict, model_class)
                with torch.no_grad():
                    self._check_fields(model(**inputs), "hidden_states", requested=False)
                    self._check_fields(model(**inputs, output_hidden_states=True), "hidden_states", requested=True)
                # The config flag works too, and an explicit argument wins over it.
                model.config.output_hidden_states = True
                with torch.no_grad():
                    self._check_fields(model(**inputs), "hidden_states", requested=True)
                    self._check_fields(model(**inputs, output_hidden_states=False), "hidden_states", requested=False)

    def test_attention_outputs(self):
        # Replaces the mixin's: the towers' attentions and, per fusion layer, the self- and cross-attentions of each
        # fusion stream, in named fields; probabilities sum to 1 and padding keys get none.
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        inputs_dict["attention_mask"][-1, -2:] = 0  # padding at the end of the last text
        padding = inputs_dict["attention_mask"] == 0
        for model_class in self.all_model_classes:
            with self.subTest(model_class.__name__):
                model = model_class._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
                inputs = self._prepare_for_class(inputs_dict, model_class)
                with torch.no_grad():
                    outputs = model(**inputs, output_attentions=True)
                    self._check_fields(outputs, "attentions", requested=True)
                    self._check_fields(model(**inputs), "attentions", requested=False)
                    model.config.output_attentions = True
                    self._check_fields(model(**inputs), "attentions", requested=True)
                    # Requesting hidden states as well adds exactly their fields.
                    with_states = model(**inputs, output_hidden_states=True)
                num_states = sum(v is not None for k, v in self._expected_shapes().items() if k.endswith("states"))
                self.assertEqual(len(with_states), len(outputs) + num_states)
                for name, expected in self._expected_shapes().items():
                    if not name.endswith("attentions") or expected is None:
                        continue
                    for probs in getattr(outputs, name):
                        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
                        if name in ("text_attentions", "fusion_text_self_attentions", "image_to_text_attentions"):
                            self.assertEqual(float(probs.masked_select(padding[:, None, None, :]).abs().max()), 0.0)

    def test_retain_grad_hidden_states_attentions(self):
        # Replaces the mixin's: gradients reach the returned hidden states and attention probabilities, those of the
        # towers and of the fusion layers, from the output each head is judged by.
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        config.output_hidden_states = config.output_attentions = True
        for model_class in self.all_model_classes:
            with self.subTest(model_class.__name__):
                model = model_class._from_config(copy.deepcopy(config), attn_implementation="eager").eval()
                outputs = model(**self._prepare_for_class(inputs_dict, model_class))
                names = [name for name, expected in self._expected_shapes().items() if expected is not None]
                for name in names:
                    getattr(outputs, name)[0].retain_grad()
                getattr(outputs, MAIN_OUTPUT[model_class]).sum().backward()
                for name in names:
                    self.assertIsNotNone(getattr(outputs, name)[0].grad, name)

    # The mixin selects hidden states by a list of layer indices wherever a submodule records them (the towers do).
    # MMFusion refuses a list: tests/test_modeling.py::test_output_hidden_states_is_a_flag_not_a_list_of_layers.
    test_can_capture_specific_layers_hidden_states = skipped_mixin_test(
        "test_can_capture_specific_layers_hidden_states",
        "output_hidden_states is a flag for MMFusion (a list is refused): two towers and two fusion streams have no "
        "single layer numbering to select hidden states by index.",
    )


class MMFusionHierarchicalTest(MMFusionCommonTests, unittest.TestCase):
    fusion_type = "hierarchical"
    runs_tower_only_eager_test = True
    runs_dtype_loading_test = True


class MMFusionHierarchicalTextToImageTest(MMFusionCommonTests, unittest.TestCase):
    fusion_type = "hierarchical"
    fusion_direction = "text_to_image"


class MMFusionCrossAttentionTest(MMFusionCommonTests, unittest.TestCase):
    fusion_type = "cross_attention"


class MMFusionLateTest(MMFusionCommonTests, unittest.TestCase):
    fusion_type = "late"


class MMFusionResNetHierarchicalTest(MMFusionCommonTests, unittest.TestCase):
    """A backbone tower (AutoBackbone): two stages of different resolution as hierarchical bridges."""

    fusion_type = "hierarchical"
    vision_tower = "resnet"
    runs_dtype_loading_test = True
    has_attentions = False  # the mixin's attention checks of get_image_features: a convolutional tower has none
    # The mixin reads the vision width from `hidden_size`-like attributes, which ResNetConfig has not (its widths are
    # `hidden_sizes`); test_vision_towers.py checks get_image_features' shapes for backbone towers.
    skip_test_image_features_output_shape = True


class MMFusionResNetLateTest(MMFusionCommonTests, unittest.TestCase):
    fusion_type = "late"
    vision_tower = "resnet"
    has_attentions = False
    skip_test_image_features_output_shape = True


class MMFusionConvStemTest(MMFusionCommonTests, unittest.TestCase):
    """A ViT tower whose patchify is a convolutional stem with BatchNorm."""

    fusion_type = "hierarchical"
    vision_tower = "conv_stem"


class MMFusionResNetFiLMTest(MMFusionCommonTests, unittest.TestCase):
    """A backbone tower whose stages the text scales and shifts (vision_film). The pretraining head, which needs an
    image embedding apart from any text, refuses such a config (tests/test_vision_film.py)."""

    fusion_type = "hierarchical"
    vision_tower = "resnet_film"
    all_model_classes = (MMFusionModel, MMFusionForImageTextClassification)
    heads = (MMFusionForImageTextClassification,)
    has_attentions = False
    skip_test_image_features_output_shape = True

    # get_image_features refuses a FiLM model with a clear error (an image has no embedding without its text):
    # tests/test_vision_film.py::test_film_refuses_what_needs_an_image_without_its_text. The mixin tests the method on
    # every class that has it.
    _NO_IMAGE_FEATURES = (
        "a tower conditioned on the text (vision_film, vision_text_attention): get_image_features refuses, an image "
        "has no embedding without a text"
    )
    test_get_image_features_output_0 = skipped_mixin_test("test_get_image_features_output_0", _NO_IMAGE_FEATURES)
    test_get_image_features_output_1 = skipped_mixin_test("test_get_image_features_output_1", _NO_IMAGE_FEATURES)
    test_get_image_features_output_2 = skipped_mixin_test("test_get_image_features_output_2", _NO_IMAGE_FEATURES)
    test_get_image_features_hidden_states = skipped_mixin_test(
        "test_get_image_features_hidden_states", _NO_IMAGE_FEATURES
    )


class MMFusionResNetTextAttentionTest(MMFusionResNetFiLMTest):
    """A backbone tower whose stages' cells read the text by cross-attention (vision_text_attention); like FiLM, an
    image has no features without its text (tests/test_vision_text_attention.py)."""

    vision_tower = "resnet_text_attention"
