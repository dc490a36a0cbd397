"""Ray Train's import path for the Transformers integration (`ray.train.huggingface.transformers`
renamed): `ft_train.huggingface.transformers` holds the same objects as
`ft_train.integrations.transformers` under Ray's names."""
