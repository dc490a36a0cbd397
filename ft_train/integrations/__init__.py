"""Integrations with the frameworks and trackers users bring: Hugging Face Transformers, PyTorch
Lightning, MLflow, TensorBoard. Each lives in a module of its own and imports its framework only
when that module is imported: `import ft_train` never imports any of them, and each is an optional
install (`pip install "ft-train[transformers]"`, `[lightning]`, `[mlflow]`, `[tensorboard]`)."""
