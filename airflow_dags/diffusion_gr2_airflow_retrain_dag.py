from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

from airflow.sdk import dag, task

from kedro.framework.session import KedroSession
from kedro.framework.project import configure_project

# Kedro settings required to run your pipeline
env = "airflow"
pipeline_name = "retrain"
project_path = Path.cwd()
package_name = "diffusion_gr2"
conf_source = "" or Path.cwd() / "conf"


def _run_kedro_node(node_names=None, namespaces=None):
    """Run a Kedro pipeline slice. Pass node_names for regular node groups or namespaces for namespace groups."""
    configure_project(package_name)
    with KedroSession.create(project_path=project_path, env=env, conf_source=conf_source) as session:
        if namespaces is not None:
            session.run(pipeline_names=[pipeline_name], namespaces=namespaces)
        else:
            session.run(pipeline_names=[pipeline_name], node_names=node_names)


@dag(
    dag_id="diffusion-gr2",
    start_date=datetime(2026,1,1),
    max_active_runs=1,
    schedule="0 3 * * 1",
    catchup=False,
    default_args=dict(
        owner="airflow",
        depends_on_past=False,
        email_on_failure=False,
        email_on_retry=False,
        retries=0,
        retry_delay=timedelta(minutes=5)
    ),
)
def diffusion_gr2():

    @task(task_id="take-in-incoming")
    def take_in_incoming():
        _run_kedro_node(node_names=["take_in_incoming"])

    @task(task_id="plan-warm-start")
    def plan_warm_start():
        _run_kedro_node(node_names=["plan_warm_start"])

    @task(task_id="prepare-dataset")
    def prepare_dataset():
        _run_kedro_node(node_names=["prepare_dataset"])

    @task(task_id="embed-item-texts")
    def embed_item_texts():
        _run_kedro_node(node_names=["embed_item_texts"])

    @task(task_id="retrieve-candidates")
    def retrieve_candidates():
        _run_kedro_node(node_names=["retrieve_candidates"])

    @task(task_id="validate-splits")
    def validate_splits():
        _run_kedro_node(node_names=["validate_splits"])

    @task(task_id="fit-item-sids")
    def fit_item_sids():
        _run_kedro_node(node_names=["fit_item_sids"])

    @task(task_id="gate-requests")
    def gate_requests():
        _run_kedro_node(node_names=["gate_requests"])

    @task(task_id="validate-candidate-lists")
    def validate_candidate_lists():
        _run_kedro_node(node_names=["validate_candidate_lists"])

    @task(task_id="generate-traces")
    def generate_traces():
        _run_kedro_node(node_names=["generate_traces"])

    @task(task_id="train-tokenizer")
    def train_tokenizer():
        _run_kedro_node(node_names=["train_tokenizer"])

    @task(task_id="build-ar-model")
    def build_ar_model():
        _run_kedro_node(node_names=["build_ar_model"])

    @task(task_id="encode-datasets")
    def encode_datasets():
        _run_kedro_node(node_names=["encode_datasets"])

    @task(task_id="midtrain-ar-copy")
    def midtrain_ar_copy():
        _run_kedro_node(node_names=["midtrain_ar_copy"])

    @task(task_id="train-ar-sft")
    def train_ar_sft():
        _run_kedro_node(node_names=["train_ar_sft"])

    @task(task_id="train-ar-rl")
    def train_ar_rl():
        _run_kedro_node(node_names=["train_ar_rl"])

    @task(task_id="convert-teacher")
    def convert_teacher():
        _run_kedro_node(node_names=["convert_teacher"])

    @task(task_id="train-cft")
    def train_cft():
        _run_kedro_node(node_names=["train_cft"])

    @task(task_id="train-opd")
    def train_opd():
        _run_kedro_node(node_names=["train_opd"])

    @task(task_id="train-diffusion-rl")
    def train_diffusion_rl():
        _run_kedro_node(node_names=["train_diffusion_rl"])

    @task(task_id="register-models")
    def register_models():
        _run_kedro_node(node_names=["register_models"])

    @task(task_id="run-gate")
    def run_gate():
        _run_kedro_node(node_names=["run_gate"])

    tasks = {
        "take-in-incoming": take_in_incoming(),
        "plan-warm-start": plan_warm_start(),
        "prepare-dataset": prepare_dataset(),
        "embed-item-texts": embed_item_texts(),
        "retrieve-candidates": retrieve_candidates(),
        "validate-splits": validate_splits(),
        "fit-item-sids": fit_item_sids(),
        "gate-requests": gate_requests(),
        "validate-candidate-lists": validate_candidate_lists(),
        "generate-traces": generate_traces(),
        "train-tokenizer": train_tokenizer(),
        "build-ar-model": build_ar_model(),
        "encode-datasets": encode_datasets(),
        "midtrain-ar-copy": midtrain_ar_copy(),
        "train-ar-sft": train_ar_sft(),
        "train-ar-rl": train_ar_rl(),
        "convert-teacher": convert_teacher(),
        "train-cft": train_cft(),
        "train-opd": train_opd(),
        "train-diffusion-rl": train_diffusion_rl(),
        "register-models": register_models(),
        "run-gate": run_gate(),
    }
    tasks["take-in-incoming"] >> tasks["plan-warm-start"]
    tasks["take-in-incoming"] >> tasks["prepare-dataset"]
    tasks["prepare-dataset"] >> tasks["embed-item-texts"]
    tasks["prepare-dataset"] >> tasks["retrieve-candidates"]
    tasks["prepare-dataset"] >> tasks["validate-splits"]
    tasks["embed-item-texts"] >> tasks["fit-item-sids"]
    tasks["plan-warm-start"] >> tasks["fit-item-sids"]
    tasks["prepare-dataset"] >> tasks["fit-item-sids"]
    tasks["prepare-dataset"] >> tasks["gate-requests"]
    tasks["retrieve-candidates"] >> tasks["gate-requests"]
    tasks["prepare-dataset"] >> tasks["validate-candidate-lists"]
    tasks["retrieve-candidates"] >> tasks["validate-candidate-lists"]
    tasks["fit-item-sids"] >> tasks["generate-traces"]
    tasks["prepare-dataset"] >> tasks["generate-traces"]
    tasks["retrieve-candidates"] >> tasks["generate-traces"]
    tasks["fit-item-sids"] >> tasks["train-tokenizer"]
    tasks["generate-traces"] >> tasks["train-tokenizer"]
    tasks["plan-warm-start"] >> tasks["train-tokenizer"]
    tasks["plan-warm-start"] >> tasks["build-ar-model"]
    tasks["train-tokenizer"] >> tasks["build-ar-model"]
    tasks["fit-item-sids"] >> tasks["encode-datasets"]
    tasks["generate-traces"] >> tasks["encode-datasets"]
    tasks["prepare-dataset"] >> tasks["encode-datasets"]
    tasks["retrieve-candidates"] >> tasks["encode-datasets"]
    tasks["train-tokenizer"] >> tasks["encode-datasets"]
    tasks["build-ar-model"] >> tasks["midtrain-ar-copy"]
    tasks["fit-item-sids"] >> tasks["midtrain-ar-copy"]
    tasks["plan-warm-start"] >> tasks["midtrain-ar-copy"]
    tasks["train-tokenizer"] >> tasks["midtrain-ar-copy"]
    tasks["encode-datasets"] >> tasks["train-ar-sft"]
    tasks["midtrain-ar-copy"] >> tasks["train-ar-sft"]
    tasks["plan-warm-start"] >> tasks["train-ar-sft"]
    tasks["train-tokenizer"] >> tasks["train-ar-sft"]
    tasks["encode-datasets"] >> tasks["train-ar-rl"]
    tasks["plan-warm-start"] >> tasks["train-ar-rl"]
    tasks["train-ar-sft"] >> tasks["train-ar-rl"]
    tasks["train-tokenizer"] >> tasks["train-ar-rl"]
    tasks["plan-warm-start"] >> tasks["convert-teacher"]
    tasks["train-ar-rl"] >> tasks["convert-teacher"]
    tasks["train-tokenizer"] >> tasks["convert-teacher"]
    tasks["convert-teacher"] >> tasks["train-cft"]
    tasks["encode-datasets"] >> tasks["train-cft"]
    tasks["plan-warm-start"] >> tasks["train-cft"]
    tasks["train-tokenizer"] >> tasks["train-cft"]
    tasks["encode-datasets"] >> tasks["train-opd"]
    tasks["plan-warm-start"] >> tasks["train-opd"]
    tasks["train-ar-rl"] >> tasks["train-opd"]
    tasks["train-cft"] >> tasks["train-opd"]
    tasks["train-tokenizer"] >> tasks["train-opd"]
    tasks["encode-datasets"] >> tasks["train-diffusion-rl"]
    tasks["plan-warm-start"] >> tasks["train-diffusion-rl"]
    tasks["train-opd"] >> tasks["train-diffusion-rl"]
    tasks["train-tokenizer"] >> tasks["train-diffusion-rl"]
    tasks["fit-item-sids"] >> tasks["register-models"]
    tasks["prepare-dataset"] >> tasks["register-models"]
    tasks["train-ar-rl"] >> tasks["register-models"]
    tasks["train-diffusion-rl"] >> tasks["register-models"]
    tasks["gate-requests"] >> tasks["run-gate"]
    tasks["register-models"] >> tasks["run-gate"]


diffusion_gr2()