"""A Trainer whose model card is the lrpe-hf card, and the train / evaluate / save steps every script shares."""

import atexit
import functools
from pathlib import Path

import torch
from transformers import Trainer

from .lora import is_adapter, save_merged_model
from .model_card import training_section, write_model_card
from .plots import plot_loss_curves


class CardTrainer(Trainer):
    """``Trainer`` with ``create_model_card`` rendering model_cards/<model_type>.md, so that ``--push_to_hub``
    uploads the lrpe-hf card (metrics, encoding, usage, what the training did) along with the weights, code and
    tokenizer. ``card`` holds the template's fields; its ``data_description`` says how the data was cut, and
    ``examples`` (what, how many an epoch), where given, what the run saw when tokens are not what it counts."""

    def __init__(self, *args, card: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.card = card
        self.card_metrics = {}
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            destroy_process_group_at_exit()

    def create_model_card(self, **kwargs):
        """The lrpe-hf card for LinearGPT / LinearRoberta / LinearViT; Transformers' own card for other models
        (e.g. a softmax teacher trained with these scripts)."""
        if not self.is_world_process_zero():
            return
        if not hasattr(self.accelerator.unwrap_model(self.model).config, "attention_options"):
            return super().create_model_card(**kwargs)
        # The Hub id where the run pushes (or names one); otherwise the output folder's path as given, so that the
        # card's snippet loads the local folder (its name alone would be looked up on the Hub from anywhere else).
        model_id = (
            self.hub_model_id
            if getattr(self, "hub_model_id", None)
            else (self.args.hub_model_id or str(self.args.output_dir))
        )
        fields = dict(self.card)
        training = training_section(self, fields.pop("data_description"), fields.pop("examples", None))
        write_model_card(
            self.args.output_dir, self.model, model_id=model_id, metrics=self.card_metrics, training=training, **fields
        )


@functools.cache
def destroy_process_group_at_exit():
    """Tear torch.distributed down when the script's process exits (once per process, after every stage it runs):
    left to the interpreter's own teardown, the process group's threads can abort a process that finished its work
    ("terminate called without an active exception", seen on two CPU processes)."""

    def destroy():
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    atexit.register(destroy)


def train_and_evaluate(trainer: CardTrainer, extra_metrics=None) -> dict:
    """Train (``--do_train``), evaluate (``--do_eval``, when there is evaluation data), then save the model, its
    state, the metrics, the loss-curve PNG and the card, and push if asked (see ``parse_script_arguments`` for
    the flags' defaults). A LoRA run saves and pushes its adapter, and writes the merged model to ``merged/``.

    ``extra_metrics(metrics)`` returns more metrics computed from the evaluation's (e.g. perplexity)."""
    args = trainer.args
    do_train, do_eval = args.do_train, args.do_eval
    if do_eval and trainer.eval_dataset is None and not do_train:
        raise ValueError("--do_eval needs evaluation data (--validation_file, a validation split or --data_dir)")
    if do_train:
        trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    metrics = {}
    if do_eval and trainer.eval_dataset is not None:
        metrics = trainer.evaluate()
        if extra_metrics:
            metrics.update(extra_metrics(metrics))
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    trainer.save_state()  # after the evaluation, so that trainer_state.json records it as the card does
    trainer.card_metrics = {
        k: v for k, v in metrics.items() if k.startswith("eval_") and "runtime" not in k and "per_second" not in k
    }
    if trainer.is_world_process_zero():
        plot_loss_curves(
            trainer.state.log_history,
            Path(trainer.args.output_dir) / "loss_curves.png",
            title=trainer.model.config.model_type,
        )
        trainer.create_model_card()
    if trainer.args.push_to_hub:
        trainer.push_to_hub()
    if is_adapter(trainer.model) and trainer.is_world_process_zero():
        save_merged_model(trainer.model, trainer.processing_class, Path(args.output_dir) / "merged")
    # Every process leaves the stage together: none exits (and tears its process group down) while another is
    # still writing what the stage saves.
    trainer.accelerator.wait_for_everyone()
    return metrics
