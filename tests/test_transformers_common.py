"""transformers' own common model tests (``ModelTesterMixin``, ``ConfigTester``) run against the three families.

The harness comes from the transformers sdist of the installed version: ``tests/fetch_transformers_harness.py``
puts it under ``tests/.transformers_harness/`` (``make test`` runs it first). Without it, this module skips.

One test class per family and positional encoding. ``lrpe_orthogonal`` (the default) runs the whole mixin;
``permute``, ``spe_sine`` and ``fastrpb`` run ``ENCODING_SUBSET`` (the tests where the encoding matters), which keeps
the module within about three minutes on two CPU cores.

Everything is built through the public API (``lrpe_hf.LinearRobertaConfig`` ... and the exported model classes);
nothing here names a submodule or a parameter of lrpe_hf.

What does not apply to linear attention is switched off through the mixin's own flags, each with its reason
(``LinearModelTestMixin``); the other skips are the harness's own (GPU, flash-attention, deepspeed, kernels,
RUN_SLOW...), with their reasons.
"""

import copy
import sys
import unittest
from unittest import mock

import fetch_transformers_harness as harness  # noqa: E402  (tests/ is on pytest's pythonpath)
import pytest
import torch

import lrpe_hf

pytestmark = pytest.mark.slow  # about a minute on 2 cores: 700 tests over three families and four encodings

_VERSION = harness.installed_version()
if not harness.is_ready(_VERSION):
    _why = harness.failure_note(_VERSION) or "not fetched yet"
    pytest.skip(
        f"transformers {_VERSION} common-test harness unavailable ({_why}); run `make test` or "
        "`python tests/fetch_transformers_harness.py` with PyPI access",
        allow_module_level=True,
    )
try:
    import parameterized  # noqa: F401  (the harness needs it; it is in the `test` extra)
except ModuleNotFoundError:
    pytest.skip("the transformers harness needs `parameterized`: pip install -e '.[test]'", allow_module_level=True)

sys.path.insert(0, str(harness.harness_dir(_VERSION)))
from transformers_tests import test_modeling_common as common  # noqa: E402
from transformers_tests.test_configuration_common import ConfigTester  # noqa: E402
from transformers_tests.test_modeling_common import (  # noqa: E402
    ModelTesterMixin,
    floats_tensor,
    ids_tensor,
    random_attention_mask,
    torch_device,
)

ENCODINGS = ("lrpe_orthogonal", "permute", "spe_sine", "fastrpb")
DEFAULT_ENCODING = "lrpe_orthogonal"

# Tests where the positional encoding makes a difference; the other encodings run only these.
ENCODING_SUBSET = (
    "test_config",
    "test_model",
    "test_save_load",
    "test_determinism",
    "test_batching_equivalence",
    "test_training",
    "test_training_gradient_checkpointing_use_reentrant_false",  # the default, as test_training_gradient_checkpointing
    "test_training_gradient_checkpointing_use_reentrant_true",
    "test_problem_types",
    "test_from_pretrained_no_checkpoint",
    "test_correct_missing_keys",
    "test_can_init_all_missing_weights",
    "test_init_weights_can_init_buffers",
    "test_all_tensors_are_parameter_or_buffer",
    "test_can_use_safetensors",
    "test_torch_save_load",
    "test_inputs_embeds_matches_input_ids",
    "test_can_be_initialized_on_meta",
    "test_hidden_states_output",
    "test_retain_grad_hidden_states_attentions",
)

# ---------------------------------------------------------------------------------------------------- known bugs
# (test name, encodings it fails for) -> reason. These tests stay failing-but-marked (strict: a fix shows up as
# XPASS, which fails the run until the mark is removed). Fixed since the harness came in (eec3a97, _init_weights
# re-creates every parameter and buffer): test_all_tensors_are_parameter_or_buffer,
# test_init_weights_can_init_buffers and test_can_init_all_missing_weights.
# test_all_tensors_are_parameter_or_buffer, test_init_weights_can_init_buffers and test_can_init_all_missing_weights
# read parameters and buffers that transformers allocates with torch.empty_like and that only _init_weights
# should fill. Uninitialised memory may hold anything, zeros included (FastRPB's weights start at
# zero), so these tests see it filled with NaN / the largest integer / True instead: the outcome is the same on
# every run.
_empty_like = torch.empty_like


def _poisoned_empty_like(*args, **kwargs):
    tensor = _empty_like(*args, **kwargs)
    if tensor.device.type != "meta" and tensor.numel():
        if tensor.dtype == torch.bool:
            poison = True
        elif tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            poison = float("nan")
        else:
            poison = torch.iinfo(tensor.dtype).max
        with torch.no_grad():
            tensor.fill_(poison)
    return tensor


def _with_poisoned_memory(test):
    def poisoned(self):
        with mock.patch.object(torch, "empty_like", _poisoned_empty_like):
            return test(self)

    poisoned.__name__ = test.__name__
    poisoned.__doc__ = test.__doc__
    return poisoned


# ---------------------------------------------------------------------------------------------------- testers
class _LinearModelTester:
    """Shared sizes: hidden 32, 2 layers, 4 heads, batch 4."""

    config_class = None
    label_kinds = {}  # model class -> "token" (B, N) | "sequence" (B,) | "span" (start/end positions)

    def __init__(
        self,
        parent,
        positional_encoding=DEFAULT_ENCODING,
        batch_size=4,
        is_training=True,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        hidden_dropout_prob=0.1,
        initializer_range=0.02,
        num_labels=3,
    ):
        self.parent = parent
        self.positional_encoding = positional_encoding
        self.batch_size = batch_size
        self.is_training = is_training
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.hidden_dropout_prob = hidden_dropout_prob
        self.initializer_range = initializer_range
        self.num_labels = num_labels

    def common_config_kwargs(self):
        return dict(
            positional_encoding=self.positional_encoding,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size,
            hidden_dropout_prob=self.hidden_dropout_prob,
            initializer_range=self.initializer_range,
            num_labels=self.num_labels,
        )

    def create_and_check_model(self, config, inputs_dict):
        for model_class in self.parent.all_model_classes:
            model = model_class(copy.deepcopy(config)).to(torch_device).eval()
            with torch.no_grad():
                outputs = model(**inputs_dict)
            self.check_output_shapes(model, outputs)

    def labels(self, model_class):
        kind = self.label_kinds.get(model_class)
        zeros = dict(dtype=torch.long, device=torch_device)
        if kind == "token":
            return {"labels": torch.zeros(self.batch_size, self.seq_length, **zeros)}
        if kind == "sequence":
            return {"labels": torch.zeros(self.batch_size, **zeros)}
        if kind == "span":
            return {
                "start_positions": torch.zeros(self.batch_size, **zeros),
                "end_positions": torch.zeros(self.batch_size, **zeros),
            }
        return {}


class LinearRobertaModelTester(_LinearModelTester):
    config_class = lrpe_hf.LinearRobertaConfig
    label_kinds = {
        lrpe_hf.LinearRobertaForMaskedLM: "token",
        lrpe_hf.LinearRobertaForTokenClassification: "token",
        lrpe_hf.LinearRobertaForSequenceClassification: "sequence",
        lrpe_hf.LinearRobertaForQuestionAnswering: "span",
    }

    def __init__(self, parent, seq_length=7, vocab_size=99, max_position_embeddings=64, **kwargs):
        super().__init__(parent, **kwargs)
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.max_position_embeddings = max_position_embeddings

    def get_config(self):
        return self.config_class(
            **self.common_config_kwargs(),
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
        )

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), input_ids, attention_mask

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, attention_mask = self.prepare_config_and_inputs()
        return config, {"input_ids": input_ids, "attention_mask": attention_mask}

    def check_output_shapes(self, model, outputs):
        b, n, h = self.batch_size, self.seq_length, self.hidden_size
        if isinstance(model, lrpe_hf.LinearRobertaModel):
            self.parent.assertEqual(outputs.last_hidden_state.shape, (b, n, h))
        elif isinstance(model, lrpe_hf.LinearRobertaForMaskedLM):
            self.parent.assertEqual(outputs.logits.shape, (b, n, self.vocab_size))
        elif isinstance(model, lrpe_hf.LinearRobertaForTokenClassification):
            self.parent.assertEqual(outputs.logits.shape, (b, n, self.num_labels))
        elif isinstance(model, lrpe_hf.LinearRobertaForSequenceClassification):
            self.parent.assertEqual(outputs.logits.shape, (b, self.num_labels))
        else:
            self.parent.assertEqual(outputs.start_logits.shape, (b, n))
            self.parent.assertEqual(outputs.end_logits.shape, (b, n))


class LinearGPTModelTester(LinearRobertaModelTester):
    config_class = lrpe_hf.LinearGPTConfig
    label_kinds = {
        lrpe_hf.LinearGPTForCausalLM: "token",
        lrpe_hf.LinearGPTForSequenceClassification: "sequence",
    }

    def get_config(self):
        config = super().get_config()
        config.pad_token_id = 0  # LinearGPTForSequenceClassification pools the last non-pad token
        return config

    def check_output_shapes(self, model, outputs):
        b, n, h = self.batch_size, self.seq_length, self.hidden_size
        if isinstance(model, lrpe_hf.LinearGPTModel):
            self.parent.assertEqual(outputs.last_hidden_state.shape, (b, n, h))
        elif isinstance(model, lrpe_hf.LinearGPTForCausalLM):
            self.parent.assertEqual(outputs.logits.shape, (b, n, self.vocab_size))
        else:
            self.parent.assertEqual(outputs.logits.shape, (b, self.num_labels))


class LinearViTModelTester(_LinearModelTester):
    config_class = lrpe_hf.LinearViTConfig
    label_kinds = {lrpe_hf.LinearViTForImageClassification: "sequence"}

    def __init__(self, parent, image_size=32, patch_size=8, num_channels=3, **kwargs):
        super().__init__(parent, **kwargs)
        self.image_size = image_size
        self.patch_size = patch_size
        self.num_channels = num_channels
        self.seq_length = (image_size // patch_size) ** 2 + 1  # the patches and the class token

    def get_config(self):
        return self.config_class(
            **self.common_config_kwargs(),
            image_size=self.image_size,
            patch_size=self.patch_size,
            num_channels=self.num_channels,
        )

    def prepare_config_and_inputs(self):
        pixel_values = floats_tensor([self.batch_size, self.num_channels, self.image_size, self.image_size])
        return self.get_config(), pixel_values

    def prepare_config_and_inputs_for_common(self):
        config, pixel_values = self.prepare_config_and_inputs()
        return config, {"pixel_values": pixel_values}

    def check_output_shapes(self, model, outputs):
        b, n, h = self.batch_size, self.seq_length, self.hidden_size
        if isinstance(model, lrpe_hf.LinearViTModel):
            self.parent.assertEqual(outputs.last_hidden_state.shape, (b, n, h))
            self.parent.assertEqual(outputs.pooler_output.shape, (b, h))
        else:
            self.parent.assertEqual(outputs.logits.shape, (b, self.num_labels))


# ---------------------------------------------------------------------------------------------------- the mixin
class LinearModelTestMixin(ModelTesterMixin):
    """What the three families share: the mixin's flags (each with why), labels per head, the config tester.

    Nothing is skipped by name: what does not apply is turned off through the mixin's own flags below, and the
    harness skips by itself what needs a GPU, flash-attention, deepspeed, the kernels library or RUN_SLOW.
    """

    model_tester_class = None
    positional_encoding = DEFAULT_ENCODING
    # model_type's lookup tables in the harness: {harness table name: model class}; see setUpClass.
    harness_tables = {}
    config_tester_kwargs = {}

    # Linear attention never forms the N x N matrix, so there are no attention weights to return: this skips
    # test_attention_outputs, the eager/SDPA/flash comparisons and the attention half of the other tests.
    has_attentions = False
    test_resize_position_embeddings = False  # relative encodings: no position table to resize
    test_can_init_all_missing_weights_before_2023 = True  # run it: the config files carry no copyright year
    # Generation keeps a recurrent LinearAttentionCache, not the tensor key/value cache GenerationTesterMixin
    # assumes (and the sdist does not ship that mixin); tests/test_generation.py covers LinearGPT's generate.
    all_generative_model_classes = ()

    @classmethod
    def setUpClass(cls):
        # transformers' mixin finds heads by class name in its own *_MAPPING_NAMES tables (labels, which classes a
        # test applies to, base models skipped in training). Let the harness's copies of those tables know this
        # family for the duration of the class; transformers itself is untouched.
        super().setUpClass()
        model_type = cls.model_tester_class.config_class.model_type
        for table, model_class in cls.harness_tables.items():
            extended = type(getattr(common, table))({**getattr(common, table), model_type: model_class.__name__})
            patcher = mock.patch.object(common, table, extended)
            patcher.start()
            cls.addClassCleanup(patcher.stop)

    def setUp(self):
        self.model_tester = self.model_tester_class(self, positional_encoding=self.positional_encoding)
        self.config_tester = ConfigTester(
            self,
            config_class=self.model_tester_class.config_class,
            positional_encoding=self.positional_encoding,
            hidden_size=32,
            num_attention_heads=4,
            **self.config_tester_kwargs,
        )

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs_dict = copy.deepcopy(inputs_dict)
        if return_labels:
            inputs_dict.update(self.model_tester.labels(model_class))
        return inputs_dict

    def test_config(self):
        self.config_tester.run_common_tests()

    def test_model(self):
        config, inputs_dict = self.model_tester.prepare_config_and_inputs_for_common()
        self.model_tester.create_and_check_model(config, inputs_dict)

    test_all_tensors_are_parameter_or_buffer = _with_poisoned_memory(
        ModelTesterMixin.test_all_tensors_are_parameter_or_buffer
    )
    test_init_weights_can_init_buffers = _with_poisoned_memory(ModelTesterMixin.test_init_weights_can_init_buffers)
    test_can_init_all_missing_weights = _with_poisoned_memory(ModelTesterMixin.test_can_init_all_missing_weights)


def _register_encoding_classes(name, base, module_globals):
    """One subclass per non-default encoding, running only ENCODING_SUBSET (the other tests are hidden)."""
    for encoding in ENCODINGS:
        if encoding == DEFAULT_ENCODING:
            continue
        suffix = "".join(part.title() for part in encoding.split("_"))
        namespace = {"positional_encoding": encoding, "__module__": base.__module__}
        hidden = [attr for attr in dir(base) if attr.startswith("test_") and attr not in ENCODING_SUBSET]
        for attr in hidden:
            if callable(getattr(base, attr)):
                namespace[attr] = None  # not a callable: unittest does not collect it
        module_globals[f"{name}{suffix}Test"] = type(f"{name}{suffix}Test", (base,), namespace)


# ---------------------------------------------------------------------------------------------------- families
class LinearRobertaModelTest(LinearModelTestMixin, unittest.TestCase):
    model_tester_class = LinearRobertaModelTester
    all_model_classes = (
        lrpe_hf.LinearRobertaModel,
        lrpe_hf.LinearRobertaForMaskedLM,
        lrpe_hf.LinearRobertaForSequenceClassification,
        lrpe_hf.LinearRobertaForTokenClassification,
        lrpe_hf.LinearRobertaForQuestionAnswering,
    )
    harness_tables = {
        "MODEL_MAPPING_NAMES": lrpe_hf.LinearRobertaModel,
        "MODEL_FOR_MASKED_LM_MAPPING_NAMES": lrpe_hf.LinearRobertaForMaskedLM,
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": lrpe_hf.LinearRobertaForSequenceClassification,
        "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES": lrpe_hf.LinearRobertaForTokenClassification,
        "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES": lrpe_hf.LinearRobertaForQuestionAnswering,
    }


class LinearGPTModelTest(LinearModelTestMixin, unittest.TestCase):
    model_tester_class = LinearGPTModelTester
    all_model_classes = (
        lrpe_hf.LinearGPTModel,
        lrpe_hf.LinearGPTForCausalLM,
        lrpe_hf.LinearGPTForSequenceClassification,
    )
    harness_tables = {
        "MODEL_MAPPING_NAMES": lrpe_hf.LinearGPTModel,
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": lrpe_hf.LinearGPTForCausalLM,
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES": lrpe_hf.LinearGPTForSequenceClassification,
    }


class LinearViTModelTest(LinearModelTestMixin, unittest.TestCase):
    model_tester_class = LinearViTModelTester
    all_model_classes = (lrpe_hf.LinearViTModel, lrpe_hf.LinearViTForImageClassification)
    harness_tables = {
        "MODEL_MAPPING_NAMES": lrpe_hf.LinearViTModel,
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES": lrpe_hf.LinearViTForImageClassification,
    }
    config_tester_kwargs = {"has_text_modality": False}
    test_resize_embeddings = False  # no token embeddings: the input "embedding" is the patch projection

    def test_model_get_set_embeddings(self):
        # The vision version of the check (as transformers' ViT tests): the input embedding is the patch projection.
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            model = model_class(copy.deepcopy(config))
            self.assertIsInstance(model.get_input_embeddings(), torch.nn.Module)
            output_embeddings = model.get_output_embeddings()
            self.assertTrue(output_embeddings is None or isinstance(output_embeddings, torch.nn.Linear))


for _name, _base in (
    ("LinearRoberta", LinearRobertaModelTest),
    ("LinearGPT", LinearGPTModelTest),
    ("LinearViT", LinearViTModelTest),
):
    _register_encoding_classes(_name, _base, globals())
del _name, _base  # a TestCase class left in the module namespace would be collected again
