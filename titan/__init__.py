"""titan: PyTorch-native pretraining of Llama-class language models."""

__version__ = "0.1.0"
