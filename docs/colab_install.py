import sys

if "google.colab" in sys.modules:
    # Colab has TensorFlow: install the keras-skip release without a TensorFlow
    # extra; `[demo]` adds the offline MNIST subset. Run this cell first.
    import subprocess
    from importlib import metadata

    keras_before = metadata.version("keras")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "keras-skip[demo]"],
        capture_output=True,
        text=True,
    )
    if installed.returncode != 0:
        raise RuntimeError(
            "pip could not install keras-skip:\n"
            + installed.stderr[-1500:]
            + "\nAlternatives: the repository's main branch, with\n"
            "  !pip install 'keras-skip[demo] @ git+https://github.com/keras-skip/keras-skip'\n"
            "or a wheel you built (python -m build) and uploaded, with\n"
            "  !pip install keras_skip-*.whl mlxtend matplotlib"
        )
    if "keras" in sys.modules and metadata.version("keras") != keras_before:
        print(
            f"pip replaced Keras {keras_before} by {metadata.version('keras')}, "
            "but this session already imported the old one: restart the session "
            "(Runtime > Restart session), then run the notebook from the top."
        )
