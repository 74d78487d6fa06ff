"""--chat-template / --chat-template-kwargs without real weights (tests/test_real_model.py has them end to end)."""
import json
import shutil

import pytest

import policy
import rollout


def test_a_replaced_template_is_used_and_saved_with_the_tokenizer(micro_path, tmp_path):
    custom = tmp_path / "custom.jinja"
    custom.write_text(policy.CHAT_TEMPLATE + "{# a replacement #}")
    _, tok = policy.load_policy(str(micro_path), chat_template=custom)
    assert tok.chat_template == custom.read_text()
    tok.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "chat_template.jinja").read_text() == custom.read_text()
    assert policy.TOOLS_TEMPLATE_PATH.read_bytes().decode() == policy.CHAT_TEMPLATE   # the tiny model's own
    with pytest.raises(policy.PolicyLoadError, match="cannot read chat template file"):
        policy.load_policy(str(micro_path), chat_template=tmp_path / "missing.jinja")


def test_template_kwargs_are_a_json_object_saved_and_read_back(micro_path, tmp_path):
    assert policy.parse_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    for bad in ("{enable_thinking: false}", "[1]", "true", ""):
        with pytest.raises(ValueError, match="JSON object"):
            policy.parse_template_kwargs(bad)
    assert policy.saved_template_kwargs(str(micro_path)) == {}
    folder = tmp_path / "ckpt"
    shutil.copytree(micro_path, folder)
    policy.save_template_kwargs(folder, {"enable_thinking": False})
    assert json.loads((folder / policy.TEMPLATE_KWARGS_FILE).read_text()) == {"enable_thinking": False}
    assert policy.template_kwargs_for(folder, None) == {"enable_thinking": False}
    assert policy.template_kwargs_for(folder, {"x": 1}) == {"x": 1}          # an explicit flag wins


@pytest.mark.parametrize("argv,needle", [
    (["--chat-template-kwargs", "nope"], "JSON object"),
    (["--chat-template", "/nonexistent/t.jinja"], "cannot read chat template file"),
    (["--model", "/nonexistent/m.gguf"], "does not exist"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
])
def test_rollout_cli_errors_are_one_line_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        rollout.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("rollout.py: error:") and needle in err


@pytest.mark.parametrize("prog", ["train.py", "evaluate.py", "rollout.py"])
def test_template_flag_mistakes_are_one_line_in_every_cli(prog, tmp_path, capsys):
    """A template file that is not UTF-8, template variables that are apply_chat_template's own arguments,
    and an empty --chat-template-kwargs: the same one-line refusal, exit 2, in all three programs."""
    import evaluate
    import train
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    main = {"train.py": train.main, "evaluate.py": evaluate.main, "rollout.py": rollout.main}[prog]
    out = ["--out", str(tmp_path / "o")] if prog != "rollout.py" else []
    for argv, needle in [(["--chat-template", str(latin1)], "not UTF-8"),
                         (["--chat-template-kwargs", '{"return_dict": true}'], "return_dict is an argument"),
                         (["--chat-template-kwargs", ""], "JSON object")]:
        try:
            code = main([*argv, *out])
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if "error:" in x]
        assert code == 2 and len(lines) == 1 and needle in lines[0] and lines[0].startswith(f"{prog}: error:"), \
            (prog, argv, err)
        assert "Traceback" not in err
