"""`python -m grpo.bench`: the dispatcher in grpo/bench/__init__.py."""

from grpo.bench import main

if __name__ == "__main__":
    main()
