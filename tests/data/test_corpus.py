from bigtrain.config.schema import DataConfig
from bigtrain.data.corpus import load_documents, shakespeare_files, strip_play_markup


def test_strip_play_markup():
    md = "# Hamlet\n\n## ACT I\n\n_Enter HAMLET_\n\n**HAMLET**  \nTo be, or not to be:  \nthat is the question.\n"
    assert (
        strip_play_markup(md)
        == "Hamlet\n\nACT I\n\nEnter HAMLET\n\nHAMLET:\nTo be, or not to be:\nthat is the question.\n"
    )


def test_embedded_corpus_is_real_shakespeare():
    files = shakespeare_files()
    assert len(files) >= 36
    docs = load_documents(DataConfig(source="shakespeare"))
    assert len(docs) == len(files)
    text = "\n".join(docs["text"])
    assert len(text) > 4_000_000
    assert "To be, or not to be" in text
    assert "**" not in text and "\n#" not in text


def test_jsonl_and_text_files(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "first doc"}\n{"body": "second doc"}\n')
    docs = load_documents(
        DataConfig(source="files", paths=[str(tmp_path / "*.jsonl")], text_key="body")
    )
    assert docs["text"] == ["first doc", "second doc"]
    (tmp_path / "b.txt").write_text("line one\nline two\n")
    docs = load_documents(DataConfig(source="files", paths=[str(tmp_path / "b.txt")]))
    assert docs["text"] == ["line one\nline two\n"]
