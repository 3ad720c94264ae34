"""The retrain pipeline as an Airflow DAG, one task per Kedro node.

Generated: kedro airflow create -p retrain -e airflow -t airflow_dags/ -j airflow_dags/dag_template.j2
Each task runs `diffusion_gr2.airflow_task.run_nodes`: a training node becomes one launched job when
the worker sets DIFFUSION_GR2_LAUNCH (e.g. "accelerate launch --config_file conf/accelerate/ddp.yaml";
docs/distributed.md), everything else runs in the task's own process, or on the project's
interpreter when Airflow has its own environment (DIFFUSION_GR2_PYTHON=.venv/bin/python; `make
setup-airflow`). The first task decides whether anything is new: when not (and a champion serves),
it skips itself and Airflow skips every task after it, so nothing is trained or registered.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task

from diffusion_gr2.airflow_task import run_nodes

env = "airflow"
pipeline_name = "retrain"
conf_source = "" or None


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

    @task(task_id="decide-retrain")
    def decide_retrain():
        run_nodes(pipeline_name, ["decide_retrain"], env, conf_source)

    @task(task_id="take-in-incoming")
    def take_in_incoming():
        run_nodes(pipeline_name, ["take_in_incoming"], env, conf_source)

    @task(task_id="plan-warm-start")
    def plan_warm_start():
        run_nodes(pipeline_name, ["plan_warm_start"], env, conf_source)

    @task(task_id="prepare-dataset")
    def prepare_dataset():
        run_nodes(pipeline_name, ["prepare_dataset"], env, conf_source)

    @task(task_id="embed-item-texts")
    def embed_item_texts():
        run_nodes(pipeline_name, ["embed_item_texts"], env, conf_source)

    @task(task_id="retrieve-candidates")
    def retrieve_candidates():
        run_nodes(pipeline_name, ["retrieve_candidates"], env, conf_source)

    @task(task_id="validate-splits")
    def validate_splits():
        run_nodes(pipeline_name, ["validate_splits"], env, conf_source)

    @task(task_id="fit-item-sids")
    def fit_item_sids():
        run_nodes(pipeline_name, ["fit_item_sids"], env, conf_source)

    @task(task_id="gate-requests")
    def gate_requests():
        run_nodes(pipeline_name, ["gate_requests"], env, conf_source)

    @task(task_id="validate-candidate-lists")
    def validate_candidate_lists():
        run_nodes(pipeline_name, ["validate_candidate_lists"], env, conf_source)

    @task(task_id="generate-traces")
    def generate_traces():
        run_nodes(pipeline_name, ["generate_traces"], env, conf_source)

    @task(task_id="train-tokenizer")
    def train_tokenizer():
        run_nodes(pipeline_name, ["train_tokenizer"], env, conf_source)

    @task(task_id="build-ar-model")
    def build_ar_model():
        run_nodes(pipeline_name, ["build_ar_model"], env, conf_source)

    @task(task_id="encode-datasets")
    def encode_datasets():
        run_nodes(pipeline_name, ["encode_datasets"], env, conf_source)

    @task(task_id="midtrain-ar-copy")
    def midtrain_ar_copy():
        run_nodes(pipeline_name, ["midtrain_ar_copy"], env, conf_source)

    @task(task_id="train-ar-sft")
    def train_ar_sft():
        run_nodes(pipeline_name, ["train_ar_sft"], env, conf_source)

    @task(task_id="record-teacher-answers")
    def record_teacher_answers():
        run_nodes(pipeline_name, ["record_teacher_answers"], env, conf_source)

    @task(task_id="teacher-self-training-examples")
    def teacher_self_training_examples():
        run_nodes(pipeline_name, ["teacher_self_training_examples"], env, conf_source)

    @task(task_id="train-ar-ei")
    def train_ar_ei():
        run_nodes(pipeline_name, ["train_ar_ei"], env, conf_source)

    @task(task_id="train-ar-rl")
    def train_ar_rl():
        run_nodes(pipeline_name, ["train_ar_rl"], env, conf_source)

    @task(task_id="convert-teacher")
    def convert_teacher():
        run_nodes(pipeline_name, ["convert_teacher"], env, conf_source)

    @task(task_id="train-cft")
    def train_cft():
        run_nodes(pipeline_name, ["train_cft"], env, conf_source)

    @task(task_id="train-opd")
    def train_opd():
        run_nodes(pipeline_name, ["train_opd"], env, conf_source)

    @task(task_id="train-diffusion-rl")
    def train_diffusion_rl():
        run_nodes(pipeline_name, ["train_diffusion_rl"], env, conf_source)

    @task(task_id="record-trajectories")
    def record_trajectories():
        run_nodes(pipeline_name, ["record_trajectories"], env, conf_source)

    @task(task_id="train-distilled")
    def train_distilled():
        run_nodes(pipeline_name, ["train_distilled"], env, conf_source)

    @task(task_id="record-trajectories-round2")
    def record_trajectories_round2():
        run_nodes(pipeline_name, ["record_trajectories_round2"], env, conf_source)

    @task(task_id="train-distilled-round2")
    def train_distilled_round2():
        run_nodes(pipeline_name, ["train_distilled_round2"], env, conf_source)

    @task(task_id="record-trajectories-round3")
    def record_trajectories_round3():
        run_nodes(pipeline_name, ["record_trajectories_round3"], env, conf_source)

    @task(task_id="train-distilled-round3")
    def train_distilled_round3():
        run_nodes(pipeline_name, ["train_distilled_round3"], env, conf_source)

    @task(task_id="choose-operating-point")
    def choose_operating_point():
        run_nodes(pipeline_name, ["choose_operating_point"], env, conf_source)

    @task(task_id="register-models")
    def register_models():
        run_nodes(pipeline_name, ["register_models"], env, conf_source)

    @task(task_id="run-gate")
    def run_gate():
        run_nodes(pipeline_name, ["run_gate"], env, conf_source)

    tasks = {
        "decide-retrain": decide_retrain(),
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
        "record-teacher-answers": record_teacher_answers(),
        "teacher-self-training-examples": teacher_self_training_examples(),
        "train-ar-ei": train_ar_ei(),
        "train-ar-rl": train_ar_rl(),
        "convert-teacher": convert_teacher(),
        "train-cft": train_cft(),
        "train-opd": train_opd(),
        "train-diffusion-rl": train_diffusion_rl(),
        "record-trajectories": record_trajectories(),
        "train-distilled": train_distilled(),
        "record-trajectories-round2": record_trajectories_round2(),
        "train-distilled-round2": train_distilled_round2(),
        "record-trajectories-round3": record_trajectories_round3(),
        "train-distilled-round3": train_distilled_round3(),
        "choose-operating-point": choose_operating_point(),
        "register-models": register_models(),
        "run-gate": run_gate(),
    }
    tasks["decide-retrain"] >> tasks["take-in-incoming"]
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
    tasks["encode-datasets"] >> tasks["record-teacher-answers"]
    tasks["train-ar-sft"] >> tasks["record-teacher-answers"]
    tasks["train-tokenizer"] >> tasks["record-teacher-answers"]
    tasks["encode-datasets"] >> tasks["teacher-self-training-examples"]
    tasks["record-teacher-answers"] >> tasks["teacher-self-training-examples"]
    tasks["plan-warm-start"] >> tasks["train-ar-ei"]
    tasks["teacher-self-training-examples"] >> tasks["train-ar-ei"]
    tasks["train-ar-sft"] >> tasks["train-ar-ei"]
    tasks["train-tokenizer"] >> tasks["train-ar-ei"]
    tasks["encode-datasets"] >> tasks["train-ar-rl"]
    tasks["plan-warm-start"] >> tasks["train-ar-rl"]
    tasks["train-ar-ei"] >> tasks["train-ar-rl"]
    tasks["train-tokenizer"] >> tasks["train-ar-rl"]
    tasks["plan-warm-start"] >> tasks["convert-teacher"]
    tasks["train-ar-rl"] >> tasks["convert-teacher"]
    tasks["train-tokenizer"] >> tasks["convert-teacher"]
    tasks["convert-teacher"] >> tasks["train-cft"]
    tasks["plan-warm-start"] >> tasks["train-cft"]
    tasks["teacher-self-training-examples"] >> tasks["train-cft"]
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
    tasks["encode-datasets"] >> tasks["record-trajectories"]
    tasks["train-diffusion-rl"] >> tasks["record-trajectories"]
    tasks["train-tokenizer"] >> tasks["record-trajectories"]
    tasks["plan-warm-start"] >> tasks["train-distilled"]
    tasks["record-trajectories"] >> tasks["train-distilled"]
    tasks["train-diffusion-rl"] >> tasks["train-distilled"]
    tasks["train-tokenizer"] >> tasks["train-distilled"]
    tasks["encode-datasets"] >> tasks["record-trajectories-round2"]
    tasks["train-distilled"] >> tasks["record-trajectories-round2"]
    tasks["train-tokenizer"] >> tasks["record-trajectories-round2"]
    tasks["plan-warm-start"] >> tasks["train-distilled-round2"]
    tasks["record-trajectories-round2"] >> tasks["train-distilled-round2"]
    tasks["train-distilled"] >> tasks["train-distilled-round2"]
    tasks["train-tokenizer"] >> tasks["train-distilled-round2"]
    tasks["encode-datasets"] >> tasks["record-trajectories-round3"]
    tasks["train-distilled-round2"] >> tasks["record-trajectories-round3"]
    tasks["train-tokenizer"] >> tasks["record-trajectories-round3"]
    tasks["plan-warm-start"] >> tasks["train-distilled-round3"]
    tasks["record-trajectories-round3"] >> tasks["train-distilled-round3"]
    tasks["train-distilled-round2"] >> tasks["train-distilled-round3"]
    tasks["train-tokenizer"] >> tasks["train-distilled-round3"]
    tasks["encode-datasets"] >> tasks["choose-operating-point"]
    tasks["train-ar-rl"] >> tasks["choose-operating-point"]
    tasks["train-distilled-round3"] >> tasks["choose-operating-point"]
    tasks["train-tokenizer"] >> tasks["choose-operating-point"]
    tasks["choose-operating-point"] >> tasks["register-models"]
    tasks["fit-item-sids"] >> tasks["register-models"]
    tasks["generate-traces"] >> tasks["register-models"]
    tasks["prepare-dataset"] >> tasks["register-models"]
    tasks["train-ar-rl"] >> tasks["register-models"]
    tasks["train-distilled-round3"] >> tasks["register-models"]
    tasks["gate-requests"] >> tasks["run-gate"]
    tasks["register-models"] >> tasks["run-gate"]
    tasks["take-in-incoming"] >> tasks["run-gate"]


diffusion_gr2()