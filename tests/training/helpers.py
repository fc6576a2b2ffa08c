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
