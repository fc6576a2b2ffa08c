"""Shared by the training tests: a few Alpaca records to train and evaluate on."""

RECORDS = [
    {"instruction": "Name a primary colour.", "output": "Red."},
    {"instruction": "Translate the word into French.", "input": "cat", "output": "Chat."},
    {"instruction": "Count to three.", "output": "One, two, three."},
    {"instruction": "What is two plus two?", "output": "Four."},
    {"instruction": "Give the opposite of the word.", "input": "hot", "output": "Cold."},
    {"instruction": "Name a planet.", "output": "Mars is a planet."},
    {"instruction": "Say hello in Spanish.", "output": "Hola."},
    {"instruction": "Name a fruit that is yellow.", "output": "A banana."},
]
EVAL_RECORDS = [{"instruction": "Name a colour.", "output": "Blue."},
                {"instruction": "Count to two.", "output": "One, two."}]


def transformers_plan(args, examples: int) -> dict:
    """What transformers' own Trainer makes of ``args`` (a ``TrainingArguments``) for a dataset of
    ``examples`` examples on one process: its number of optimiser steps, warmup steps, checkpoint
    interval and learning rate at each step, each from transformers' code, as the reference for ours."""
    import torch
    import transformers

    trainer = transformers.Trainer(model=torch.nn.Linear(1, 1), args=args,
                                   train_dataset=[{"x": torch.zeros(1)}] * examples)
    max_steps = trainer.set_initial_training_values(args, trainer.get_train_dataloader())[-1]
    state = transformers.TrainerState()
    state.compute_steps(args, max_steps)
    warmup = args.get_warmup_steps(max_steps)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    scheduler = transformers.get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                                           num_training_steps=max_steps,
                                           scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
    lrs = []
    for _ in range(max_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return {"max_steps": max_steps, "warmup_steps": warmup, "save_steps": state.save_steps, "lrs": lrs}
