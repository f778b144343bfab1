"""What each option of conf/ needs beside it to compose and build, for the tests that walk every
option (tests/app/test_configs.py builds each, tests/app/test_app_checks.py checks each)."""

from typing import Dict, List

# A data option only fits the model it was written for.
MODEL_OF_DATA: Dict[str, str] = {
    "text": "gpt",
    "hf_text": "hf",
    "synthetic": "gpt",
    "synthetic_vectors": "mlp",
    "synthetic_images": "convnet",
    "dataset": "hf",
    "custom": "custom",
}
# What a data option needs set besides its model: the dataset's file and tokenizer (neither is read
# until the data's setup, so any names do); data=custom's classes, the user's own (tests/support).
SETTINGS_OF_DATA: Dict[str, List[str]] = {
    "dataset": ["data.path=rows.jsonl", "data.tokenizer=tokenizer_dir"],
    "custom": [
        "data._target_=support.user_modules.UserTokens",
        "model._target_=support.user_modules.UserGPT2",
    ],
}
# model=custom names a module of the user's own (tests/support/user_modules.py) and the data's length.
SETTINGS_OF_MODEL: Dict[str, List[str]] = {
    "custom": ["model._target_=support.user_modules.UserGPT2", "data.seq_len=32"]
}
